"""LFM2-VL (Lfm2VlProcessor + Lfm2VlImageProcessor, torchvision only; LFM2 short-conv / attention hybrid)."""
