"""Gemma 3 (Gemma3Processor)."""
