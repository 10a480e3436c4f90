"""PaddleOCR-VL (PaddleOCRVLProcessor; ERNIE-4.5 decoder, NaViT-style vision tower, 3-D mRoPE)."""
