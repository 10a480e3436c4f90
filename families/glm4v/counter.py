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
from typing import ClassVar

from transformers.models.glm4v.image_processing_pil_glm4v import smart_resize as glm4v_smart_resize
from transformers.models.glm46v.image_processing_pil_glm46v import smart_resize as glm46v_smart_resize

from families.counter import MediaCount, MediaRejected
from families.glm4v.settings import Glm4vSettings
from families.processor import ProcessorBundle, ProcessorLoadError
from families.qwen2_vl.counter import GridCounter
from schemas.dataset_config import VideoSampling
from schemas.media import VideoMeta

SmartResize = Callable[..., tuple[int, int]]
# Each processor class with the image processor module whose smart_resize it calls.
SMART_RESIZE: dict[str, SmartResize] = {
    "Glm4vProcessor": glm4v_smart_resize,
    "Glm46VProcessor": glm46v_smart_resize,
}
IMAGE_PROCESSORS = ("Glm4vImageProcessor", "Glm46VImageProcessor")


@dataclass(frozen=True, kw_only=True, slots=True)
class Glm4vCounter(GridCounter):
    counts_video: ClassVar[bool] = False  # video samples take the real processor (module docstring)

    settings: Glm4vSettings  # <|image|> / <|video|> placeholders, the effective image settings
    smart_resize: SmartResize

    @classmethod
    def from_processor(cls, bundle: ProcessorBundle) -> Glm4vCounter:
        ip = bundle.image_processor
        if not type(ip).__name__.startswith(IMAGE_PROCESSORS):
            raise ProcessorLoadError(
                f"{bundle.source}: {bundle.processor_class} with {type(ip).__name__}; the closed form knows only "
                f"{' / '.join(IMAGE_PROCESSORS)} resizing"
            )
        return cls(settings=Glm4vSettings.from_processor(bundle), smart_resize=SMART_RESIZE[bundle.processor_class])

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) the image processor resizes to; its ValueError becomes MediaRejected."""
        if width <= 0 or height <= 0:
            raise MediaRejected(f"image of size {width}x{height}")
        s = self.settings
        try:
            return self.smart_resize(
                num_frames=s.image_temporal_patch_size,
                height=height,
                width=width,
                temporal_factor=s.image_temporal_patch_size,
                factor=s.patch_size * s.merge_size,
                min_pixels=s.min_pixels,
                max_pixels=s.max_pixels,
            )
        except ValueError as exc:
            raise MediaRejected(str(exc)) from exc

    def count_video(self, meta: VideoMeta, sampling: VideoSampling) -> MediaCount:
        raise MediaRejected("GLM-V video has no closed-form count; it needs the real processor (torchvision)")
