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

Video (``Gemma4VideoProcessor`` + ``Gemma4Processor.replace_video_token``): the chat template
writes ``"\\n\\n<|video|>\\n\\n"`` per video; the processor samples frames (`sample_frames`), resizes
every frame by the image rule at the video budget (70 soft tokens in the checkpoints) and
replaces ``<|video|>`` with, per frame, its timestamp ``mm:ss`` (frame index / source fps), a
space, ``<|image>`` + n x ``<|video|>`` + ``<image|>``, the frames joined by spaces. The first
timestamp merges with the template's ``"\\n\\n"`` in BPE, so the expansion is spliced as text
(``expansion_runs``, its soft-token runs declared) and the conversation tokenized whole.
Example (checkpoint settings, 32 frames): a 10 s 320 x 240 clip at 25 fps -> frames 0, 7, 15,
... 242 -> ``"00:00 <|image>`` + 63 x ``<|video|>`` + ``<image|> 00:00 <|image>...<image|> 00:09
...``: 32 x 63 soft tokens, grid (32, 7, 9).

The dataset's sampling (``VideoSampling``) in the processor's own terms
(`processor_video_kwargs`): ``fps: null`` keeps every frame (``do_sample_frames=False``);
otherwise the processor's sampler. With ``num_frames`` set (32 in every checkpoint) it takes
exactly that many frames uniformly -- the dataset's ``max_frames``, when lower, is passed as
``num_frames``; the fps cannot be (the processor refuses ``fps`` beside ``num_frames``) -- and a
video with fewer frames is a ``processor_rejected`` row, as the processor raises. Only a video
config with ``num_frames`` null samples at the dataset's fps; there a count outside the
dataset's ``min_frames`` / ``max_frames`` is an ``unsupported_media`` row (the processor has no
such clamp, and an estimate is never written).

The model attends both ways inside each run of soft tokens on its sliding-window layers when
its text config says ``use_bidirectional_attention: "vision"`` (``image_attention``;
`train.block_attention` applies it per sample): an image's run, and each video *frame*'s run
(``get_block_sequence_ids_for_mask``: maximal runs of ``mm_token_type_ids`` 1 or 2, and the
frames are separated by ``<image|>`` timestamp ``<|image>``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from families.counter import MediaCount, MediaRejected
from families.gemma4.settings import Gemma4Settings, Gemma4VideoSettings
from families.processor import ProcessorBundle, ProcessorLoadError
from families.run_text import RunText
from packvlm.sample_error import SampleError
from schemas.dataset_config import VideoSampling
from schemas.media import VideoMeta
from schemas.reasons import Reason

VIDEO_TOKEN = "<|video|>"  # Gemma4Processor.video_token: the template's placeholder and the frames' soft token


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
    video: Gemma4VideoSettings
    image_token_id: int  # <|image|>: the template's placeholder and the soft token
    boi_token_id: int  # <|image>
    eoi_token_id: int  # <image|>
    video_token_id: int  # <|video|>: the template's placeholder and each frame's soft token
    boi_token: str
    eoi_token: str
    processor_class: str

    @classmethod
    def from_processor(cls, bundle: ProcessorBundle) -> Gemma4Counter:
        tokens = {a: tokenizer_token(bundle, a) for a in ("image_token", "boi_token", "eoi_token")}
        ids = {a: bundle.token_id(t, a) for a, t in tokens.items()}
        return cls(
            settings=Gemma4Settings.from_processor(bundle),
            video=Gemma4VideoSettings.from_bundle(bundle),
            image_token_id=ids["image_token"],
            boi_token_id=ids["boi_token"],
            eoi_token_id=ids["eoi_token"],
            video_token_id=bundle.token_id(VIDEO_TOKEN, "video_token"),
            boi_token=tokens["boi_token"],
            eoi_token=tokens["eoi_token"],
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

    def sample_frames(self, meta: VideoMeta, sampling: VideoSampling) -> list[int]:
        """The frame indices the processor takes with `processor_video_kwargs` (module docstring)."""
        total = meta.num_frames
        if sampling.fps is None:
            return list(range(total))  # do_sample_frames=False: load_video keeps every frame
        kwargs = self.processor_video_kwargs(sampling)
        if "num_frames" in kwargs:
            count = int(kwargs["num_frames"])
        else:  # default_sample_indices_fn with fps
            count = max(1, int(total / meta.fps * sampling.fps))
            low, high = sampling.min_frames, sampling.max_frames
            if (low is not None and count < low) or (high is not None and count > high):
                raise SampleError(
                    Reason.UNSUPPORTED_MEDIA,
                    f"Gemma 4 samples {count} frames of this video at {sampling.fps} fps, outside the dataset's "
                    f"min_frames/max_frames [{low}, {high}]: its processor has no such clamp; change the fps or bounds",
                )
        if count > total:
            raise MediaRejected(
                f"Gemma 4's processor samples {count} frames, more than the video's {total} (it raises); set the "
                "dataset's max_frames or video fps: null (every frame)"
            )
        return (np.arange(count, dtype=int) * total // count).tolist()

    def expansion_runs(self, timestamps: list[float], per_frame: int) -> RunText:
        """``Gemma4Processor.replace_video_token``: per frame ``"mm:ss <|image>"`` + soft tokens + ``"<image|>"``,
        the frames joined by spaces."""
        if not timestamps:
            return RunText(("",), ())
        stamps = [f"{int(seconds // 60):02d}:{int(seconds % 60):02d} {self.boi_token}" for seconds in timestamps]
        between = [f"{self.eoi_token} {stamp}" for stamp in stamps[1:]]
        return RunText((stamps[0], *between, self.eoi_token), ((VIDEO_TOKEN, per_frame),) * len(stamps))

    def count_video(self, meta: VideoMeta, sampling: VideoSampling) -> MediaCount:
        if not self.video.do_resize:
            raise SampleError(
                Reason.UNSUPPORTED_MEDIA,
                f"{self.processor_class}: the video processor's do_resize is false, so frames keep their own size "
                "and are not counted in closed form; set do_resize true (every released Gemma 4 checkpoint does)",
            )
        indices = self.sample_frames(meta, sampling)
        rows, cols = self.video.soft_grid(meta.width, meta.height)
        per_frame = rows * cols
        timestamps = [index / meta.fps for index in indices]  # VideoMetadata.timestamps
        return MediaCount(
            kind="video",
            grid_t=len(indices),
            grid_h=rows,
            grid_w=cols,
            num_tokens=len(indices) * per_frame,
            expansion=(),
            expansion_runs=self.expansion_runs(timestamps, per_frame),
            frame_indices=tuple(indices),
            timestamps=tuple(timestamps),
        )

    def processor_video_kwargs(self, sampling: VideoSampling) -> dict[str, Any]:
        """The dataset's sampling as ``Gemma4Processor`` keywords (module docstring)."""
        if sampling.fps is None:
            return {"do_sample_frames": False}
        if self.video.num_frames is None:
            return {"do_sample_frames": True, "fps": sampling.fps}
        count = self.video.num_frames
        if sampling.max_frames is not None:
            count = min(count, sampling.max_frames)
        return {"do_sample_frames": True, "num_frames": count}
