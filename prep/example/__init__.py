"""Offline generators of a tiny Qwen-VL processor directory and a small multimodal dataset.

They serve the README quickstart (``prep example DIR``) and the test fixtures: no network,
no model weights, byte-identical output for the same arguments.
"""
