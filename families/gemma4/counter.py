"""Gemma 4 (``Gemma4Processor`` + ``Gemma4ImageProcessorPil``): variable-resolution soft-token blocks.

Image (transformers 5.24, ``models/gemma4/``): the chat template writes ``"\\n\\n<|image|>\\n\\n"``
per image; ``Gemma4Processor.replace_image_token`` replaces each ``<|image|>`` with
``<|image>`` + n x ``<|image|>`` + ``<image|>`` (boi, soft tokens, eoi: all special tokens, so
the ids splice without touching the text around), where n = ``num_soft_tokens_per_image`` of the
image processor: the aspect-preserving resize of `families.gemma4.settings` (sides multiples of
48 px within ``max_soft_tokens`` x 9 patches of 16 px) pooled 3 x 3. Unlike Gemma 3 the count
varies with the size, there are no crops, and no text joins the expansion.

Example (google/gemma-4-31B-it, budget 280): 640 x 480 -> resized 912 x 672 (w x h) -> 19 x 14 =
266 soft tokens, grid (1, 14, 19); a 1 x 1 image -> 768 x 768 -> 256; 3000 x 16 -> 48 px high,
factor 3.67: 58.7 x 10998 px ideal -> 48 x 10992 -> 1 x 229 = 229.

The model attends both ways inside each image's run of soft tokens on its sliding-window
layers when its text config says ``use_bidirectional_attention: "vision"``
(``image_attention``; `train.block_attention` applies it per sample). Video: the processor
samples frames with its torchvision video processor and writes per-frame ``mm:ss`` timestamps;
not counted here yet, so a video is an ``unsupported_media`` error row, as audio is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from families.counter import MediaCount
from families.gemma4.settings import Gemma4Settings
from families.processor import ProcessorBundle, ProcessorLoadError
from packvlm.sample_error import SampleError
from schemas.dataset_config import VideoSampling
from schemas.media import VideoMeta
from schemas.reasons import Reason

NO_VIDEO_TOKEN = -1  # no token id is negative: the splice finds no video placeholder


def tokenizer_token(bundle: ProcessorBundle, attribute: str) -> str:
    """``tokenizer.boi_token`` / ``eoi_token`` / ``image_token``: what ``Gemma4Processor.__init__`` reads."""
    token = getattr(bundle.tokenizer, attribute, None)
    if not isinstance(token, str) or not token:
        raise ProcessorLoadError(f"{bundle.source}: the Gemma 4 tokenizer has no {attribute} (tokenizer_config.json)")
    return token


@dataclass(frozen=True, kw_only=True, slots=True)
class Gemma4Counter:
    image_attention: ClassVar[str] = "bidirectional"  # each image's soft tokens, on sliding layers

    settings: Gemma4Settings  # shared with the layout
    image_token_id: int  # <|image|>: the template's placeholder and the soft token
    boi_token_id: int  # <|image>
    eoi_token_id: int  # <image|>
    processor_class: str
    video_token_id: int = NO_VIDEO_TOKEN

    @classmethod
    def from_processor(cls, bundle: ProcessorBundle) -> Gemma4Counter:
        ids = {a: bundle.token_id(tokenizer_token(bundle, a), a) for a in ("image_token", "boi_token", "eoi_token")}
        return cls(
            settings=Gemma4Settings.from_processor(bundle),
            image_token_id=ids["image_token"],
            boi_token_id=ids["boi_token"],
            eoi_token_id=ids["eoi_token"],
            processor_class=bundle.processor_class,
        )

    def count_image(self, width: int, height: int) -> MediaCount:
        rows, cols = self.settings.soft_grid(width, height)
        num_tokens = rows * cols
        return MediaCount(
            kind="image",
            grid_t=1,
            grid_h=rows,
            grid_w=cols,
            num_tokens=num_tokens,
            expansion=(self.boi_token_id, *([self.image_token_id] * num_tokens), self.eoi_token_id),
        )

    def count_video(self, meta: VideoMeta, sampling: VideoSampling) -> MediaCount:
        raise SampleError(
            Reason.UNSUPPORTED_MEDIA,
            f"Gemma 4 video is not counted in closed form yet ({self.processor_class} samples frames with its "
            "torchvision video processor); drop the video or use a family that counts video",
        )

    def processor_video_kwargs(self, sampling: VideoSampling) -> dict[str, Any]:
        return {}
