"""Qwen2.5-Omni and Qwen3-Omni images: the Qwen2-VL resize with the Omni placeholder tokens.

Both processors (``Qwen2_5OmniProcessor``, ``Qwen3OmniMoeProcessor``) use the Qwen2-VL PIL
image processor (``models/auto/image_processing_auto.py`` maps ``qwen2_5_omni`` and
``qwen3_omni_moe`` to ``Qwen2VLImageProcessorPil``) and add no ``images_kwargs`` of their own,
so the loaded image processor's settings are the effective ones. Image rules:

1. ``image_processing_pil_qwen2_vl.smart_resize`` with factor patch x merge (Qwen2.5-Omni-7B:
   14 x 2 = 28; Qwen3-Omni-30B-A3B: 16 x 2 = 32), 3136..12845056 pixels; an aspect ratio
   > 200 raises ValueError (here :class:`MediaRejected`). Counted by
   :class:`families.qwen2_vl.counter.GridCounter`.
2. ``replace_image_token`` (``processing_qwen2_5_omni.py`` / ``processing_qwen3_omni_moe.py``):
   ``image_token * (grid_thw.prod() // merge_size**2)``. The image token is the tokenizer's
   ``image_token``: ``<|IMAGE|>`` (Qwen2.5-Omni), ``<|image_pad|>`` (Qwen3-Omni). The chat
   template wraps it in ``<|vision_bos|>`` / ``<|vision_start|>`` ... ``_eos|>`` / ``_end|>``,
   special tokens, so the expansion is ids (nothing merges).

Example (Qwen2.5-Omni-7B, 333 x 517): smart_resize -> 336 x 504 (w x h), grid (1, 36, 24),
216 ``<|IMAGE|>``; Qwen3-Omni: 320 x 512, grid (1, 32, 20), 160 ``<|image_pad|>``.

Video has no closed form here (``counts_video = False``): ``OmniModalProcessorMixin`` can
interleave the audio track's tokens with the video's (``replace_video_with_audio_token``), the
video processor needs torchvision, and the Omni processors override the video pixel limits
(``videos_kwargs``). Video samples go to the real processor, or become error rows where it
cannot run. Audio is out of scope: the dataset readers take no audio items.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from families.counter import MediaCount, MediaRejected
from families.processor import ProcessorBundle
from families.qwen2_vl.counter import GridCounter
from families.qwen_omni.settings import QwenOmniSettings
from schemas.dataset_config import VideoSampling
from schemas.media import VideoMeta


@dataclass(frozen=True, kw_only=True, slots=True)
class QwenOmniCounter(GridCounter):
    counts_video: ClassVar[bool] = False

    settings: QwenOmniSettings
    processor_class: str

    @classmethod
    def from_processor(cls, bundle: ProcessorBundle) -> QwenOmniCounter:
        return cls(settings=QwenOmniSettings.from_processor(bundle), processor_class=bundle.processor_class)

    def count_video(self, meta: VideoMeta, sampling: VideoSampling) -> MediaCount:
        raise MediaRejected(f"{self.processor_class} video has no closed form; only the real processor counts it")
