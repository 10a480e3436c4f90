"""Kimi K2.5 VL (Kimi_K25ForConditionalGeneration, Kimi_K25Processor: torchvision-only image processor)."""
