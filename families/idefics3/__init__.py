"""Idefics3, SmolVLM and SmolVLM2 (Idefics3Processor, SmolVLMProcessor)."""
