"""Qwen2.5-Omni and Qwen3-Omni thinkers, images only (Qwen2_5OmniProcessor, Qwen3OmniMoeProcessor)."""
