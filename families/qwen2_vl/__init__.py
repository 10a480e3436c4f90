"""Qwen2-VL and Qwen2.5-VL (Qwen2VLProcessor, Qwen2_5_VLProcessor)."""
