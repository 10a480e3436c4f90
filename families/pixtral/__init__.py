"""Pixtral and Mistral 3 (PixtralProcessor, Mistral3Processor)."""
