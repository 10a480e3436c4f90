"""LLaVA-NeXT and LLaVA-OneVision (LlavaNextProcessor, LlavaOnevisionProcessor)."""
