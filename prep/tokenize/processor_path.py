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

import bisect
import difflib
import io
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from PIL import Image
from transformers import BatchFeature, ProcessorMixin
from transformers.image_utils import load_image
from transformers.processing_utils import ProcessingKwargs
from transformers.video_utils import load_video

from families.counter import MediaCount
from families.processor import ProcessorBundle
from families.registry import find_counter
from packvlm.sample_error import SampleError
from prep.sources.conversation import Conversation
from prep.sources.media import LmdbPool, MediaError, read_bytes
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
    import av  # deferred: only datasets with video need PyAV

    if isinstance(video_url_or_urls, list):
        return list(zip(*[fetch_videos_with_pyav(x, sample_indices_fn) for x in video_url_or_urls], strict=True))
    try:
        return load_video(video_url_or_urls, backend="pyav", sample_indices_fn=sample_indices_fn)
    except (av.error.FFmpegError, IndexError) as exc:  # IndexError: a file without a video stream
        raise SampleError(Reason.BAD_VIDEO, f"{video_url_or_urls}: video does not decode with PyAV ({exc})") from exc


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
    if _starts_with_bos(bundle, rendered):
        kwargs["add_special_tokens"] = False
    try:
        with _pyav_decoding(processor):
            out = processor(text=[rendered.text], images=media.images or None, videos=media.videos or None, **kwargs)
    except ValueError as exc:
        raise SampleError(Reason.PROCESSOR_REJECTED, f"processor rejected the sample: {exc}") from exc
    except AttributeError as exc:  # e.g. Qwen2.5-Omni on transformers 5.12 reads its video processor for images
        if getattr(processor, "video_processor", ()) is None:
            raise ReferenceUnavailable(
                f"{bundle.processor_class} needs its video processor (torchvision): {exc}"
            ) from exc
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
    extra: dict[str, Any] = {"return_offsets_mapping": True}
    if REPLACEMENT_OFFSETS in ProcessingKwargs.__annotations__:  # transformers 5.13+
        extra[REPLACEMENT_OFFSETS] = True
    rendered, out, inputs = run_processor(bundle, conv, sampling, lmdb, **extra)
    ids = [int(t) for t in np.asarray(out["input_ids"][0]).tolist()]
    if "text_replacement_offsets" in out:
        offsets = [tuple(o) for o in np.asarray(out["offset_mapping"][0]).tolist()]
        mask = mask_from_offsets(offsets, rendered.assistant_spans, out["text_replacement_offsets"][0] or [])
    else:  # older transformers do not say where they expanded media
        mask = mask_by_alignment(
            bundle.tokenizer, rendered, ids, add_special_tokens=not _starts_with_bos(bundle, rendered)
        )
    media = _media_counts(bundle, conv, out, inputs.num_bytes)
    return TokenizedSample(input_ids=ids, loss_mask=mask, media=media)


REPLACEMENT_OFFSETS = "return_text_replacement_offsets"


def _starts_with_bos(bundle: ProcessorBundle, rendered: RenderedText) -> bool:
    bos = bundle.tokenizer.bos_token
    return bos is not None and rendered.text.startswith(bos)


def mask_from_offsets(
    offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]], replacements: Sequence[Mapping[str, Any]]
) -> npt.NDArray[np.uint8]:
    """1 for each token overlapping an assistant span of the rendered text, the spans shifted past the
    media placeholders the processor expanded before them (``replacements``: its
    ``text_replacement_offsets``, ``span`` in the rendered text, ``new_span`` in the expanded one)."""
    ends = [int(r["span"][1]) for r in replacements]
    gained = [0] + [int(r["new_span"][1]) - int(r["span"][1]) for r in replacements]
    mask = np.zeros(len(offsets), dtype=np.uint8)
    for start, end in spans:
        lo, hi = start + gained[bisect.bisect_right(ends, start)], end + gained[bisect.bisect_right(ends, end)]
        for pos, (token_start, token_end) in enumerate(offsets):
            if token_start < hi and token_end > lo:
                mask[pos] = 1
    return mask


def mask_by_alignment(
    tokenizer: Any, rendered: RenderedText, expanded_ids: Sequence[int], *, add_special_tokens: bool
) -> npt.NDArray[np.uint8]:
    """The assistant mask of the rendered text, carried onto the processor's expanded ids.

    The rendered text alone tokenizes to the same ids except where the processor expanded a
    placeholder; tokens the alignment matches keep their mask, inserted or re-merged tokens
    (media expansions, never trained on) get 0.
    """
    encoded = tokenizer(rendered.text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    plain = mask_from_offsets([tuple(o) for o in encoded["offset_mapping"]], rendered.assistant_spans, [])
    mask = np.zeros(len(expanded_ids), dtype=np.uint8)
    matcher = difflib.SequenceMatcher(None, list(encoded["input_ids"]), list(expanded_ids), autojunk=False)
    for a, b, size in matcher.get_matching_blocks():
        mask[b : b + size] = plain[a : a + size]
    return mask


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
