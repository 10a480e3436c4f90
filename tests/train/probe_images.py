"""The probe images of the 8-bit pixel tests (`tests/train/test_pixels.py`, `tests/train/test_patch_rows.py`)."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def probe_image(width: int, height: int, seed: int) -> Image.Image:
    """A JPEG round trip of seeded noise over a gradient (what decode_image hands a layout)."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, width, dtype=np.float64)[None, :, None]
    pixels = np.clip(ramp + rng.normal(0, 40, (height, width, 3)), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
    return Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")
