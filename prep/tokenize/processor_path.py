"""Running the real HF processor on decoded media: the source of truth.

Used two ways: as the exact (slow) path for families without a closed-form counter, and by
``--verify-fraction`` to check closed-form samples token for token. Images are decoded the
way transformers' ``load_image`` does from a path (EXIF transpose, RGB), LMDB bytes included.

Videos are passed as paths and decoded by the video processor's ``fetch_videos``, which in
transformers picks torchcodec, else ``torchvision.io.read_video``: gone since torchvision 0.26,
so transformers 5.8 - 5.12 fail inside with an AttributeError and 5.2x raise ImportError
unless torchcodec is installed. Here every call decodes with transformers' own PyAV reader
(``load_video(..., backend="pyav")``; PyAV is a packvlm dependency, and the one
``prep.sources.media`` reads frame counts with), so it works on every torchvision.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import av

import numpy as np
from PIL import Image
from transformers import BatchFeature, ProcessorMixin
from transformers.image_utils import load_image
from transformers.video_utils import load_video

from prep.sources.conversation import Conversation
from prep.sources.media import LmdbPool, MediaError, read_bytes
from prep.tokenize.errors import SampleError
from prep.tokenize.families.base import MediaCount, find_counter
from prep.tokenize.processor import ProcessorBundle
from prep.tokenize.sample import TokenizedSample
from prep.tokenize.template import RenderedText, render_with_spans
from schemas.dataset_config import VideoSampling
from schemas.reasons import Reason


class ReferenceUnavailable(RuntimeError):
    """The real processor cannot run this sample here (e.g. video without torchvision)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MediaInputs:
    """What the processor is called with, plus each item's encoded size in media order."""

    images: list[Image.Image]
    videos: list[str]  # file paths: the processor's video loader opens them
    num_bytes: list[int]


def _media_inputs(bundle: ProcessorBundle, conv: Conversation, lmdb: LmdbPool) -> MediaInputs:
    inputs = MediaInputs(images=[], videos=[], num_bytes=[])
    for item in conv.media:
        if item.kind == "video":
            if bundle.processor is None or getattr(bundle.processor, "video_processor", None) is None:
                raise ReferenceUnavailable("no video processor loaded (torchvision missing)")
            try:
                inputs.num_bytes.append(os.stat(item.ref.path).st_size)
            except FileNotFoundError as exc:
                raise SampleError(Reason.MISSING_MEDIA, f"file {item.ref.path!r} does not exist") from exc
            inputs.videos.append(item.ref.path)
            continue
        try:
            data = read_bytes(item.ref, lmdb)
            inputs.images.append(load_image(Image.open(io.BytesIO(data))))
        except MediaError as exc:
            raise SampleError(exc.reason, str(exc)) from exc
        except Image.DecompressionBombError as exc:  # the tokenizer checks sizes first; PIL's own limit, still
            raise SampleError(Reason.IMAGE_TOO_LARGE, f"{item.ref.format()}: {exc}") from exc
        except (OSError, SyntaxError, ValueError) as exc:
            raise SampleError(Reason.CORRUPT_IMAGE, f"{item.ref.format()}: {exc}") from exc
        inputs.num_bytes.append(len(data))
    return inputs


def _require_processor(bundle: ProcessorBundle) -> ProcessorMixin:
    if bundle.processor is None:
        raise ReferenceUnavailable(f"processor {bundle.processor_class!r} could not be built here")
    return bundle.processor


def fetch_videos_with_pyav(video_url_or_urls: Any, sample_indices_fn: Callable[..., Any] | None = None) -> Any:
    """``BaseVideoProcessor.fetch_videos`` (same arguments and results, 5.8 - 5.24) with PyAV decoding."""
    if isinstance(video_url_or_urls, list):
        return list(zip(*[fetch_videos_with_pyav(x, sample_indices_fn) for x in video_url_or_urls], strict=True))
    return load_video(video_url_or_urls, backend="pyav", sample_indices_fn=sample_indices_fn)


@contextmanager
def _pyav_decoding(processor: ProcessorMixin) -> Iterator[None]:
    """For the duration of one call, the processor's video processor decodes with PyAV (module docstring)."""
    video_processor = getattr(processor, "video_processor", None)
    if video_processor is None:
        yield
        return
    video_processor.fetch_videos = fetch_videos_with_pyav  # this instance only; removed after the call
    try:
        yield
    finally:
        del video_processor.fetch_videos


def run_processor(
    bundle: ProcessorBundle, conv: Conversation, sampling: VideoSampling, lmdb: LmdbPool, **extra: Any
) -> tuple[RenderedText, BatchFeature, MediaInputs]:
    """Render with the chat template and call the processor on text + decoded media."""
    processor = _require_processor(bundle)
    rendered = render_with_spans(bundle.tokenizer, bundle.chat_template, conv.messages, conv.tools)
    media = _media_inputs(bundle, conv, lmdb)
    kwargs: dict[str, Any] = dict(extra)
    if media.videos:
        factory = find_counter(bundle.processor_class)
        if factory is not None:
            kwargs.update(factory(bundle).processor_video_kwargs(sampling))
        elif sampling.fps is not None:
            kwargs.update(fps=sampling.fps, do_sample_frames=True)
    bos = bundle.tokenizer.bos_token
    if bos is not None and rendered.text.startswith(bos):
        kwargs["add_special_tokens"] = False
    try:
        with _pyav_decoding(processor):
            out = processor(text=[rendered.text], images=media.images or None, videos=media.videos or None, **kwargs)
    except av.error.FFmpegError as exc:  # before ValueError: some FFmpeg errors are ValueErrors too
        raise SampleError(Reason.BAD_VIDEO, f"video does not decode with PyAV: {exc}") from exc
    except ValueError as exc:
        raise SampleError(Reason.PROCESSOR_REJECTED, f"processor rejected the sample: {exc}") from exc
    except AttributeError as exc:  # e.g. Qwen2.5-Omni on transformers 5.12 reads its video processor for images
        if getattr(processor, "video_processor", ()) is None:
            raise ReferenceUnavailable(f"{type(processor).__name__} needs its video processor (torchvision): {exc}") from exc
        raise
    return rendered, out, media


def reference_input_ids(
    bundle: ProcessorBundle, conv: Conversation, sampling: VideoSampling, lmdb: LmdbPool
) -> list[int]:
    """The processor's own input_ids for this conversation."""
    _, out, _ = run_processor(bundle, conv, sampling, lmdb)
    return [int(t) for t in np.asarray(out["input_ids"][0]).tolist()]


def tokenize_with_processor(
    bundle: ProcessorBundle, conv: Conversation, sampling: VideoSampling, lmdb: LmdbPool
) -> TokenizedSample:
    """Exact path for families without a counter: the processor's ids, our template-derived mask."""
    rendered, out, inputs = run_processor(
        bundle, conv, sampling, lmdb, return_offsets_mapping=True, return_text_replacement_offsets=True
    )
    # transformers annotates each generation span as an int; they are (start, end) character pairs
    spans: list[Any] = [rendered.assistant_spans]
    masked = _require_processor(bundle)._adjust_assistant_masks_indices(dict(out), spans)
    ids = [int(t) for t in np.asarray(masked["input_ids"][0]).tolist()]
    mask = np.asarray(masked["assistant_masks"][0], dtype=np.uint8)
    media = _media_counts(bundle, conv, masked, inputs.num_bytes)
    return TokenizedSample(input_ids=ids, loss_mask=mask, media=media)


def _media_counts(
    bundle: ProcessorBundle, conv: Conversation, out: Mapping[str, Any], num_bytes: list[int]
) -> list[tuple[str, MediaCount]]:
    """Each item's grid as the processor reports it (width/height are not measured here)."""
    grids = {k: np.asarray(out[f"{k}_grid_thw"]).tolist() if f"{k}_grid_thw" in out else [] for k in ("image", "video")}
    merge = getattr(bundle.image_processor, "merge_size", 1) or 1
    used = {"image": 0, "video": 0}
    counts = []
    for item, size in zip(conv.media, num_bytes, strict=True):
        k = used[item.kind]
        used[item.kind] += 1
        t, h, w = grids[item.kind][k] if k < len(grids[item.kind]) else (1, 0, 0)
        count = MediaCount(
            kind=item.kind,
            grid_t=t,
            grid_h=h,
            grid_w=w,
            num_tokens=t * h * w // merge**2,
            expansion=(),
            num_bytes=size,
        )
        counts.append((item.ref.format(), count))
    return counts
