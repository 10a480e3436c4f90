"""Gemma 3 (``Gemma3Processor`` + ``Gemma3ImageProcessorPil``): fixed 256-token image blocks.

Image (transformers 5.23, ``models/gemma3/``): every image, crop or not, is resized to the
checkpoint's square size and becomes ``image_seq_length`` (256) ``<image_soft_token>`` ids.
``Gemma3Processor.__init__`` builds ``full_image_sequence`` =
``"\\n\\n" + <start_of_image> + 256 x <image_soft_token> + <end_of_image> + "\\n\\n"`` and
``Gemma3Processor.replace_image_token`` puts it where the chat template wrote
``<start_of_image>`` (``ProcessorMixin.get_text_with_replacements``: each occurrence in order,
as text). The ``"\\n\\n"`` pieces merge with the text around them in BPE (``"Look:\\n\\n"`` is
one Gemma token), so the expansion is spliced as *text* (``MediaCount.expansion_runs``, the
soft-token run declared) and the conversation tokenized once.

Pan-and-scan (``do_pan_and_scan``; off unless the processor's ``images_kwargs`` turn it on:
``Gemma3Processor.images_kwargs`` sets False, 256, 4, 1.2 and ``ProcessorMixin._merge_kwargs``
passes them over ``preprocessor_config.json``'s ``null`` values). The crop count k follows
``image_processing_pil_gemma3.Gemma3ImageProcessorPil.pan_and_scan``, for w >= h (mirrored
for portrait): none when w / h < min_ratio; n = floor(w / h + 0.5), n = min(n, floor(w /
min_crop)), clamped to [2, max_crops]; none when min(ceil(w / n), h) < min_crop; else k = n
crops in one row. With k crops ``replace_image_token`` writes ``"Here is the original image "
+ full + " and here are some crops to help you see better " + " ".join([full] * k)``.

Example (gemma-3-4b-it, pan-and-scan on): 1200 x 400 -> ratio 3, n = min(3, floor(1200/256)
= 4) = 3, crops 400 x 400 >= 256 -> k = 3: 4 x 256 soft tokens, ``num_tiles`` 4, recorded as
grid (1, rows=1, cols=3); pan-and-scan off: 256 soft tokens, grid (1, 1, 1), one tile.

Gemma 3 attends bidirectionally inside each image block (``image_attention``). It has no video
input: a video is an ``unsupported_media`` error row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from families.counter import NO_VIDEO_TOKEN, MediaCount
from families.gemma3.settings import Gemma3Settings, tokenizer_token
from families.processor import ProcessorBundle
from families.run_text import Piece, RunText
from packvlm.sample_error import SampleError
from schemas.dataset_config import VideoSampling
from schemas.media import VideoMeta
from schemas.reasons import Reason


@dataclass(frozen=True, kw_only=True, slots=True)
class Gemma3Counter:
    image_attention: ClassVar[str] = "bidirectional"  # each image block attends both ways

    settings: Gemma3Settings  # shared with the layout
    image_token_id: int  # <start_of_image>: the template's per-image placeholder
    full_image_runs: RunText  # "\n\n<start_of_image>" + soft tokens + "<end_of_image>\n\n", the soft-token run declared
    processor_class: str
    video_token_id: int = NO_VIDEO_TOKEN

    @classmethod
    def from_processor(cls, bundle: ProcessorBundle) -> Gemma3Counter:
        boi = tokenizer_token(bundle, "boi_token")
        eoi = tokenizer_token(bundle, "eoi_token")
        settings = Gemma3Settings.from_processor(bundle)
        soft = settings.soft_token
        return cls(
            settings=settings,
            image_token_id=bundle.token_id(boi, "boi_token"),
            full_image_runs=RunText.of([f"\n\n{boi}", (soft, settings.image_seq_length), f"{eoi}\n\n"]),
            processor_class=bundle.processor_class,
        )

    @property
    def full_image_sequence(self) -> str:
        """``Gemma3Processor.full_image_sequence``: one image's expansion written out."""
        return self.full_image_runs.text

    def crop_grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, cols) of pan-and-scan crops; (0, 0) when off or not triggered."""
        pan_and_scan = self.settings.pan_and_scan
        return (0, 0) if pan_and_scan is None else pan_and_scan.crop_grid(width, height)

    def count_image(self, width: int, height: int) -> MediaCount:
        rows, cols = self.crop_grid(width, height)
        num_crops = rows * cols
        full = self.full_image_runs
        text = full
        if num_crops:  # Gemma3Processor.replace_image_token
            pieces: list[Piece | RunText] = ["Here is the original image ", full]
            pieces += [" and here are some crops to help you see better ", full]
            for _ in range(num_crops - 1):
                pieces += [" ", full]  # " ".join of the crops
            text = RunText.of(pieces)
        return MediaCount(
            kind="image",
            grid_t=1,
            grid_h=max(rows, 1),
            grid_w=max(cols, 1),
            num_tokens=self.settings.image_seq_length * (1 + num_crops),
            expansion=(),
            expansion_runs=text,
            num_tiles=1 + num_crops,
        )

    def count_video(self, meta: VideoMeta, sampling: VideoSampling) -> MediaCount:
        raise SampleError(
            Reason.UNSUPPORTED_MEDIA,
            f"Gemma 3 has no video input ({self.processor_class} takes images only); "
            "drop the video or use a video model",
        )

    def processor_video_kwargs(self, sampling: VideoSampling) -> dict[str, Any]:
        return {}
