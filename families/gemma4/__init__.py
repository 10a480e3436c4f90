"""Gemma 4 (Gemma4Processor)."""
