"""Plumbing shared by the `prep` stages and `train`: atomic writes and Energon load hooks."""
