"""Contracts between packvlm stages: on-disk names, Arrow schemas, configs and manifests.

Every stage reads and writes only what is declared here; later stages import these
declarations and never re-declare them.
"""
