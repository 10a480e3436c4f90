"""Qwen3-VL and Qwen3.5 (Qwen3VLProcessor)."""
