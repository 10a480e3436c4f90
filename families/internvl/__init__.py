"""InternVL 3 / 3.5 (InternVLProcessor)."""
