"""Pure per-sample logic of `prep tokenize`: a conversation -> exact token ids + mask.

No Ray, no click, no files written: a :class:`SampleTokenizer` is built once per worker
(processor, counter, LMDB handles) and maps one conversation (from any reader of
:mod:`prep.sources.formats`) to a :class:`TokenizedSample`
or raises :class:`SampleError`. Exactness: the template text is tokenized once, then each
media placeholder token is replaced by the ids the processor would put there, which the
family counter computes in closed form from header-only sizes. Families without a counter
run the real processor on decoded media: slow, still exact, never an estimate.

Example (Qwen2-VL, one 448x448 image): rendered text ``...<|vision_start|><|image_pad|>
<|vision_end|>Describe<|im_end|>...`` -> one ``<|image_pad|>`` id replaced by 256 of them
(448/28 * 448/28), ``media[0].grid_thw = (1, 32, 32)``.
"""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import numpy.typing as npt

from families.counter import MediaCount, MediaCounter, MediaRejected
from families.processor import ProcessorBundle
from families.registry import find_counter
from packvlm.sample_error import SampleError
from prep.sources.conversation import Conversation, MediaItem, MediaKind
from prep.sources.header_memo import HeaderMemo
from prep.sources.media import (
    DECODE_LIMIT_PIXELS,
    LmdbPool,
    MediaError,
    check_media_roots,
    image_header,
    video_header,
)
from prep.tokenize.content_style import as_content_lists, needs_content_lists
from prep.tokenize.count_memo import CountMemo
from prep.tokenize.encode import tokenize_rendered
from prep.tokenize.expansion import ExpandedText, expand_placeholders
from prep.tokenize.processor_path import ReferenceUnavailable, tokenize_with_processor
from prep.tokenize.runs import RunEncoder
from prep.tokenize.sample import TokenizedSample
from prep.tokenize.template import ChatRenderer, RenderedText, render_with_spans
from schemas.dataset_config import VideoSampling
from schemas.media_ref import MediaRef
from schemas.reasons import Reason


class SampleTokenizer:
    """Per-worker state, opened once: processor pieces, family counter, LMDB environments."""

    def __init__(
        self,
        bundle: ProcessorBundle,
        *,
        max_length: int | None = None,
        max_image_pixels: int = DECODE_LIMIT_PIXELS,
        media_roots: tuple[str, ...] = (),
    ) -> None:
        self.bundle = bundle
        self.max_length = max_length
        self.max_image_pixels = max_image_pixels
        self.media_roots = tuple(os.path.realpath(r) for r in media_roots)
        factory = find_counter(bundle.processor_class)
        self.counter: MediaCounter | None = factory(bundle) if factory else None
        self.memo = CountMemo(self.counter) if self.counter is not None else None
        self.counts_video: bool = getattr(self.counter, "counts_video", True)  # a counter's settings are frozen
        self._placeholder_text: dict[int, str] = {}
        self.content_lists = needs_content_lists(bundle.tokenizer, bundle.chat_template)
        self.renderer = ChatRenderer(bundle.tokenizer, bundle.chat_template)
        self.runs = RunEncoder(bundle.tokenizer)
        self.lmdb = LmdbPool()
        self.headers = HeaderMemo()

    def tokenize(self, conv: Conversation, sampling: VideoSampling) -> TokenizedSample:
        """Exact ids and loss mask of one conversation; a bad sample raises SampleError."""
        conv = self.for_template(conv)
        if self.memo is None:
            self._check_image_sizes(conv)
            sample = tokenize_with_processor(self.bundle, conv, sampling, self.lmdb)
        elif not self.counts_video and any(m.kind == "video" for m in conv.media):
            self._check_image_sizes(conv)
            sample = self._video_with_processor(conv, sampling)
        else:
            sample = self._tokenize_closed_form(self.memo, conv, sampling)
        if self.max_length is not None and sample.num_tokens > self.max_length:
            raise SampleError(Reason.TOO_LONG, f"{sample.num_tokens} tokens > --max-length {self.max_length}")
        return sample

    def forget_media(self) -> None:
        """Drop what this worker remembers per media item (counts, headers), keeping the template's
        shape cache: benchmarks measure every item as a new file of a new size."""
        if self.memo is not None:
            self.memo.clear()
        self.headers.clear()

    def check_confined(self, conv: Conversation, dataset_roots: tuple[str, ...] = ()) -> None:
        """Before any media is opened: each item inside --media-root and the dataset's ``media_root``."""
        for item in conv.media:
            try:
                check_media_roots(item.ref, self.media_roots, dataset_roots)
            except MediaError as exc:
                raise SampleError(exc.reason, str(exc)) from exc

    def for_template(self, conv: Conversation) -> Conversation:
        """The conversation as the template renders it: string turns as content lists where it drops them."""
        if not self.content_lists:  # see prep.tokenize.content_style
            return conv
        return replace(conv, messages=as_content_lists(conv.messages))

    def _check_image_sizes(self, conv: Conversation) -> None:
        """Before the real processor decodes them: images past --max-image-pixels are error rows."""
        for item in conv.media:
            if item.kind == "image":
                try:
                    image_header(item.ref, self.lmdb, self.max_image_pixels)
                except MediaError as exc:
                    raise SampleError(exc.reason, str(exc)) from exc

    def _video_with_processor(self, conv: Conversation, sampling: VideoSampling) -> TokenizedSample:
        """A family whose video has no closed form (``counts_video = False``): the real processor, or an error row."""
        try:
            return tokenize_with_processor(self.bundle, conv, sampling, self.lmdb)
        except ReferenceUnavailable as exc:
            raise SampleError(
                Reason.PROCESSOR_REJECTED,
                f"{self.bundle.processor_class} video is counted only by the real processor, which cannot run here: "
                f"{exc}",
            ) from exc

    def _tokenize_closed_form(self, memo: CountMemo, conv: Conversation, sampling: VideoSampling) -> TokenizedSample:
        counts = self._counts(memo, conv.media, sampling)
        rendered: RenderedText | ExpandedText = render_with_spans(
            self.bundle.tokenizer, self.bundle.chat_template, conv.messages, conv.tools, renderer=self.renderer
        )
        counter = memo.counter
        placeholders: dict[MediaKind, int] = {"image": counter.image_token_id, "video": counter.video_token_id}
        text_kinds = _text_level_kinds(counts)
        for kind in text_kinds:
            token = self._token_text(placeholders[kind])
            expansions = [c.expansion_runs for _, c in counts if c.kind == kind and c.expansion_runs is not None]
            rendered = expand_placeholders(rendered, token, expansions, kind)
        text = tokenize_rendered(self.bundle.tokenizer, rendered, self.runs)
        id_level = {kind: token for kind, token in placeholders.items() if kind not in text_kinds}
        ids, mask = splice_media(text.input_ids, text.loss_mask, counts, id_level)
        return TokenizedSample(input_ids=ids, loss_mask=mask, media=counts)

    def _token_text(self, token_id: int) -> str:
        """A placeholder token's text, looked up once per worker."""
        text = self._placeholder_text.get(token_id)
        if text is None:
            text = self._placeholder_text[token_id] = self.bundle.tokenizer.convert_ids_to_tokens(token_id)
        return text

    def _counts(self, memo: CountMemo, media: list[MediaItem], sampling: VideoSampling) -> list[tuple[str, MediaCount]]:
        """Each item's formatted ref and count, numbered by its place among its sample's items of its kind.

        A counter whose expansion names that place (MiniCPM-V's ``<image_id>k</image_id>``) defines
        ``numbered(count, index)``, which the memo applies; ``count_image`` / ``count_video`` answer for index 0."""
        places = {"image": 0, "video": 0}
        counts = []
        for item in media:
            index = places[item.kind]
            places[item.kind] = index + 1
            counts.append((item.ref.format(), self._count(memo, item.kind, item.ref, sampling, index)))
        return counts

    def _count(
        self, memo: CountMemo, kind: MediaKind, ref: MediaRef, sampling: VideoSampling, index: int
    ) -> MediaCount:
        """The counter's answer for one item (the ``index``-th of its kind), with its source and encoded size."""
        try:
            if kind == "image":
                image = self.headers.image_header(ref, self.lmdb, self.max_image_pixels)
                return memo.image(image.width, image.height, index, image.num_bytes)
            video = video_header(ref)
            return memo.video(video.meta, sampling, index, video.num_bytes)
        except MediaError as exc:
            raise SampleError(exc.reason, str(exc)) from exc
        except MediaRejected as exc:
            raise SampleError(Reason.PROCESSOR_REJECTED, f"{ref.format()}: {exc}") from exc


def _text_level_kinds(counts: list[tuple[str, MediaCount]]) -> tuple[MediaKind, ...]:
    """Kinds whose items expand as text; a counter must not mix text and id expansions in one kind.

    One set of (kind, as text) pairs rather than a set per kind: it runs for every sample."""
    found = {(c.kind, c.expansion_runs is not None) for _, c in counts}  # expansion_text would build the text
    for kind in _KINDS:
        if (kind, True) in found and (kind, False) in found:
            raise ValueError(f"counter mixes text and id expansions for {kind}s")
    return tuple(kind for kind in _KINDS if (kind, True) in found)


_KINDS: tuple[MediaKind, ...] = ("image", "video")


def splice_media(
    ids: list[int],
    mask: npt.NDArray[np.uint8],
    counts: list[tuple[str, MediaCount]],
    placeholders: dict[MediaKind, int],
) -> tuple[list[int], npt.NDArray[np.uint8]]:
    """Replace the k-th placeholder token of each kind in ``placeholders`` by the k-th item's ids.

    The placeholder count must match the media count exactly (user text that spells a
    placeholder token would otherwise shift every item, as it breaks the real processor).
    Kinds absent from ``placeholders`` were expanded as text before tokenizing; a negative token
    (a family without that kind's token) is never searched for: no id is negative.
    The mask is built as bytes, each piece a slice of the text's mask or zeros, joined once: numpy
    slice assignments cost more per item than the bytes they copy.
    """
    found: list[tuple[int, tuple[int, ...]]] = []  # (placeholder position, the item's ids)
    for kind, token in placeholders.items():
        where = _indices(ids, token) if token >= 0 else []
        items = [c.expansion for _, c in counts if c.kind == kind]
        if len(where) != len(items):
            raise SampleError(
                Reason.MEDIA_TAG_MISMATCH,
                f"rendered text has {len(where)} {kind} placeholder tokens for {len(items)} {kind}s "
                "(does the text spell a placeholder token?)",
            )
        found.extend(zip(where, items))
    if not found:
        return ids, mask
    found.sort(key=lambda hit: hit[0])
    bits = mask.tobytes()
    out_ids: list[int] = []
    out_bits: list[bytes] = []
    prev = 0
    for pos, expansion in found:
        out_ids += ids[prev:pos]
        out_ids += expansion
        out_bits += (bits[prev:pos], bytes(len(expansion)))
        prev = pos + 1
    out_ids += ids[prev:]
    out_bits.append(bits[prev:])
    return out_ids, np.frombuffer(bytearray().join(out_bits), dtype=np.uint8)


def _indices(ids: list[int], token: int) -> list[int]:
    """Where ``token`` occurs in ``ids``: ``list.index`` scans in C (a video sample holds thousands of
    ids and a handful of placeholders; a Python loop over every id cost ~0.1 ms a sample)."""
    found: list[int] = []
    try:
        while True:
            found.append(ids.index(token, found[-1] + 1 if found else 0))
    except ValueError:
        return found
