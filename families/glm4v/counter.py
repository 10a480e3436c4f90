"""GLM-4.1V / GLM-4.5V (``Glm4vProcessor``) and GLM-4.6V / GLM-OCR (``Glm46VProcessor``).

Image (transformers 5.23, ``models/glm4v/image_processing_pil_glm4v.py``; the glm46v module
defines the same function): ``Glm4vImageProcessorPil.resize`` calls ``smart_resize`` with
``num_frames = temporal_patch_size`` (2), ``factor = patch_size * merge_size`` (28) and
``size.shortest_edge`` / ``size.longest_edge`` as min / max pixels. Unlike Qwen's, that
``smart_resize``:

1. first scales a side below 28 up: ``scale = max(28/h, 28/w)``, ``h, w = int(h*scale), int(w*scale)``;
2. rejects an aspect ratio > 200 (after that scaling) with ValueError: :class:`MediaRejected`;
3. rounds h, w to multiples of 28 and compares ``t_bar * h_bar * w_bar`` (t_bar = 2) with the
   budget, so the effective pixel cap per image is max_pixels / 2 (9,633,792 / 2 in the
   checkpoints); over it, ``beta = sqrt(2*h*w / max_pixels)`` and sides floor to multiples of 28; under
   min_pixels they ceil up.

``patchify`` gives grid (1, hb/14, wb/14); ``Glm4vProcessor.replace_image_token`` writes
``<|image|>`` x (grid product / merge_size^2). The chat template renders each image as
``<|begin_of_image|><|image|><|end_of_image|>``: the expansion sits between special tokens, so
it is spliced in ids. Example (GLM-4.1V, 12544..9633792): 1920x1080 -> 1932x1092 fits
(2*1092*1932 < 9633792) -> grid (1, 78, 138), 2691 ``<|image|>`` ids; 1x1 -> 28x28 -> 1.

Video has no closed form here (:attr:`Glm4vCounter.counts_video` is False: video samples run
the real processor, exact, or become ``processor_rejected`` error rows). The expansion itself
would splice cleanly (per temporal pair ``<|begin_of_image|>`` + S ``<|image|>`` +
``<|end_of_image|>`` + timestamp text, the text between special tokens), but the frames cannot
be predicted from header data: ``Glm4vVideoProcessor.sample_frames`` (fps 2; past
``max_duration`` 300 s, 600 frames spread over the clip; duplicates dropped; last frame
repeated to an even count) starts from ``metadata.duration``, which
``BaseVideoProcessor.fetch_videos`` reads with torchcodec (``duration_seconds`` of the
container, not frames / fps), and the video processor needs torchvision; neither runs here to
check a closed form against. ``Glm46VVideoProcessor`` samples differently again (6 / 2 / 1
frames per second for clips up to 30 / 300 / 2400 s, at most 640 frames) and writes
``"{t:.1f} seconds"`` where ``Glm4vProcessor`` writes ``int(t)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from transformers.models.glm4v.image_processing_pil_glm4v import smart_resize as glm4v_smart_resize
from transformers.models.glm46v.image_processing_pil_glm46v import smart_resize as glm46v_smart_resize

from families.counter import MediaCount, MediaRejected
from families.processor import ProcessorBundle, ProcessorLoadError
from families.settings import effective_image_settings
from schemas.dataset_config import VideoSampling
from schemas.media import VideoMeta

SmartResize = Callable[..., tuple[int, int]]
# Each processor class with the image processor module whose smart_resize it calls.
SMART_RESIZE: dict[str, SmartResize] = {
    "Glm4vProcessor": glm4v_smart_resize,
    "Glm46VProcessor": glm46v_smart_resize,
}
IMAGE_PROCESSORS = ("Glm4vImageProcessor", "Glm46VImageProcessor")


def _pixel_limits(size: Any) -> tuple[int, int]:
    get = size.get if isinstance(size, dict) else lambda k: getattr(size, k, None)
    shortest, longest = get("shortest_edge"), get("longest_edge")
    if not shortest or not longest:  # Glm4vImageProcessorPil.resize raises the same
        raise ProcessorLoadError(f"GLM image processor size {size!r} lacks shortest_edge/longest_edge")
    return int(shortest), int(longest)


@dataclass(frozen=True, kw_only=True, slots=True)
class Glm4vCounter:
    counts_video: ClassVar[bool] = False  # video samples take the real processor (module docstring)

    image_token_id: int  # <|image|>: the template's per-image placeholder and its expansion
    video_token_id: int  # <|video|>
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    smart_resize: SmartResize

    @classmethod
    def from_processor(cls, bundle: ProcessorBundle) -> Glm4vCounter:
        ip = bundle.image_processor
        if not type(ip).__name__.startswith(IMAGE_PROCESSORS):
            raise ProcessorLoadError(
                f"{bundle.source}: {bundle.processor_class} with {type(ip).__name__}; the closed form knows only "
                f"{' / '.join(IMAGE_PROCESSORS)} resizing"
            )
        kwargs = effective_image_settings(bundle, ("size", "patch_size", "temporal_patch_size", "merge_size"))
        min_pixels, max_pixels = _pixel_limits(kwargs["size"])
        return cls(
            image_token_id=bundle.token_id("<|image|>", "image_token"),
            video_token_id=bundle.token_id("<|video|>", "video_token"),
            patch_size=int(kwargs["patch_size"]),
            temporal_patch_size=int(kwargs["temporal_patch_size"]),
            merge_size=int(kwargs["merge_size"]),
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            smart_resize=SMART_RESIZE[bundle.processor_class],
        )

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) the image processor resizes to; its ValueError becomes MediaRejected."""
        if width <= 0 or height <= 0:
            raise MediaRejected(f"image of size {width}x{height}")
        try:
            return self.smart_resize(
                num_frames=self.temporal_patch_size,
                height=height,
                width=width,
                temporal_factor=self.temporal_patch_size,
                factor=self.patch_size * self.merge_size,
                min_pixels=self.min_pixels,
                max_pixels=self.max_pixels,
            )
        except ValueError as exc:
            raise MediaRejected(str(exc)) from exc

    def count_image(self, width: int, height: int) -> MediaCount:
        hb, wb = self.resized(width, height)
        gh, gw = hb // self.patch_size, wb // self.patch_size
        n = gh * gw // self.merge_size**2
        return MediaCount(
            kind="image", grid_t=1, grid_h=gh, grid_w=gw, num_tokens=n, expansion=(self.image_token_id,) * n
        )

    def count_video(self, meta: VideoMeta, sampling: VideoSampling) -> MediaCount:
        raise MediaRejected("GLM-V video has no closed-form count; it needs the real processor (torchvision)")

    def processor_video_kwargs(self, sampling: VideoSampling) -> dict[str, Any]:
        """``Glm4vVideoProcessor.sample_frames`` takes ``fps`` only (min/max frames are not used)."""
        return {} if sampling.fps is None else {"fps": sampling.fps, "do_sample_frames": True}
