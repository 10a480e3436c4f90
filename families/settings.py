"""Processor settings several families read: call-time image kwargs, pixel limits, video, patch grids.

A family's own settings (``families/<name>/settings.py``) are built from these once and shared
by its counter and its layout; the patch-grid families' (Qwen-VL, GLM-4.xV, Qwen-Omni) derive
from `GridSettings`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Self, TypedDict

import transformers

from families.processor import ProcessorBundle
from packvlm.processor_kwargs import call_images_kwargs, class_images_kwargs


def _size_limits(size: Any, raw: dict[str, Any]) -> tuple[int, int]:
    """``min_pixels``/``max_pixels`` keys override ``size``, as the processors' __init__ does."""
    get = size.get if isinstance(size, dict) else lambda k, d=None: getattr(size, k, d)
    shortest = raw.get("min_pixels", get("shortest_edge"))
    longest = raw.get("max_pixels", get("longest_edge"))
    if shortest is None or longest is None:
        raise ValueError(f"processor size {size!r} lacks shortest_edge/longest_edge pixel limits")
    return int(shortest), int(longest)


def merged_images_kwargs(bundle: ProcessorBundle) -> dict[str, Any]:
    """What a processor call passes its image processor before the caller's kwargs.

    The class's image defaults over ``preprocessor_config.json`` (`packvlm.processor_kwargs`);
    when the processor itself could not be built, its class's declared defaults.
    """
    if bundle.processor is not None:
        return call_images_kwargs(bundle.processor)
    return class_images_kwargs(getattr(transformers, bundle.processor_class, None))


def effective_image_settings(
    bundle: ProcessorBundle, names: tuple[str, ...], merged: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Each image setting as the image processor receives it at call time.

    A processor call passes its class's image defaults over ``preprocessor_config.json``
    (InternVL's ``crop_to_patches``, Gemma 3's pan-and-scan; `merged_images_kwargs`): a
    merged value wins where it is set, else the loaded image processor's own attribute.
    """
    merged = merged_images_kwargs(bundle) if merged is None else merged
    image_processor = bundle.image_processor
    return {n: merged[n] if merged.get(n) is not None else getattr(image_processor, n, None) for n in names}


def image_pixel_limits(image_processor: Any) -> tuple[int, int]:
    """(min_pixels, max_pixels) of the *loaded* image processor (its ``size`` dict)."""
    return _size_limits(image_processor.size, {})


@dataclass(frozen=True, kw_only=True, slots=True)
class VideoSettings:
    """Video processor settings; from the loaded video processor or its config file."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    min_frames: int
    max_frames: int
    fps: float | None
    do_sample_frames: bool
    cap_pixels_per_frame: bool
    max_video_tokens: int

    @classmethod
    def from_config(cls, config: dict[str, Any], class_defaults: dict[str, Any]) -> VideoSettings:
        """``config`` wins; ``class_defaults`` fill only keys the config does not set."""
        merged = {**class_defaults, **{k: v for k, v in config.items() if v is not None}}
        min_pixels, max_pixels = _size_limits(merged.get("size") or {}, merged)
        return cls(
            patch_size=int(merged["patch_size"]),
            temporal_patch_size=int(merged["temporal_patch_size"]),
            merge_size=int(merged["merge_size"]),
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            min_frames=int(merged["min_frames"]),
            max_frames=int(merged["max_frames"]),
            fps=None if merged.get("fps") is None else float(merged["fps"]),
            do_sample_frames=bool(merged.get("do_sample_frames")),
            cap_pixels_per_frame=bool(merged.get("cap_pixels_per_frame")),
            max_video_tokens=int(merged["max_video_tokens"]),
        )


class GridTokensAndVideo(TypedDict):
    """The `GridSettings` fields every grid family reads alike (`GridSettings.tokens_and_video`)."""

    image_token_id: int
    video_token_id: int
    video: VideoSettings | None
    temporal_patch_size: int
    second_per_grid_ts: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class GridSettings:
    """What both faces of a patch-grid family read from the processor, derived once.

    The counter resizes with the image fields and writes ``image_token_id`` placeholders; the
    layout (`families.qwen2_vl.layout.GridLayout`) divides grids by ``merge_size`` and writes
    ``second_per_grid_ts`` from ``temporal_patch_size``. A family names its placeholders in
    ``tokens`` (the tokenizer's own attributes win, as in the processor) and, where its counter
    counts video in closed form, the video processor's class defaults.
    """

    tokens: ClassVar[tuple[str, str]] = ("<|image_pad|>", "<|video_pad|>")
    #: the video processor class's attributes, for keys its config leaves out; None: no closed-form video
    video_class_defaults: ClassVar[dict[str, Any] | None] = None

    image_token_id: int
    video_token_id: int
    patch_size: int  # the image processor's patch side, in pixels
    merge_size: int  # patches merged per token side
    min_pixels: int
    max_pixels: int
    video: VideoSettings | None  # from ``video_class_defaults``; None where video is not counted
    temporal_patch_size: int  # frames per temporal patch of the video processor
    second_per_grid_ts: bool  # the processor returns it (Qwen2.5-VL) for the model's rope index

    @classmethod
    def from_processor(cls, bundle: ProcessorBundle) -> Self:
        """Image settings from the loaded image processor (the Qwen processors pass none of their own)."""
        image_processor = bundle.image_processor
        min_pixels, max_pixels = image_pixel_limits(image_processor)
        return cls(
            **cls.tokens_and_video(bundle),
            patch_size=int(image_processor.patch_size),
            merge_size=int(image_processor.merge_size),
            min_pixels=min_pixels,
            max_pixels=max_pixels,
        )

    @classmethod
    def tokens_and_video(cls, bundle: ProcessorBundle) -> GridTokensAndVideo:
        """The fields every grid family reads alike: placeholder ids and the video processor's settings."""
        processor = bundle.processor
        video = None
        if cls.video_class_defaults is not None:
            video = VideoSettings.from_config(bundle.video_config, cls.video_class_defaults)
            temporal = video.temporal_patch_size
        else:
            loaded = getattr(processor, "video_processor", None) if processor is not None else None
            temporal = getattr(loaded, "temporal_patch_size", None) or bundle.video_config.get("temporal_patch_size", 2)
        names = getattr(processor, "model_input_names", None) or []
        return GridTokensAndVideo(
            image_token_id=bundle.token_id(cls.tokens[0], "image_token"),
            video_token_id=bundle.token_id(cls.tokens[1], "video_token"),
            video=video,
            temporal_patch_size=int(temporal),
            second_per_grid_ts="second_per_grid_ts" in names,
        )
