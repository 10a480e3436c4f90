"""ShareGPT records (JSON array or JSONL) -> conversations.

Both spellings are accepted: ``{"role": "user", "content": ...}`` and
``{"from": "human", "value": ...}``; the spec's ``columns`` and ``tags`` rename them.
``<image>``/``<video>`` tags in user turns take the next entry of the record's media lists,
in order; a tag count that differs from the list length is an error, never a silent fix.
Media entries are references (:class:`schemas.media_ref.MediaRef`) relative to the spec's
``media_dir``.

Example: ``{"conversations": [{"from": "human", "value": "<image>Describe."}, {"from":
"gpt", "value": "A cat."}], "images": ["a.jpg"]}`` -> messages ``[{"role": "user",
"content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}, {"role":
"assistant", "content": "A cat."}]``, media ``[image MEDIA_DIR/a.jpg]``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import PurePosixPath
from typing import Any

from prep.sources.conversation import Conversation, MediaItem, MediaKind, Message
from prep.sources.errors import RecordError
from prep.sources.formats.base import SourceRecord, register_reader
from prep.sources.records import Chunk, decode_record, read_chunk
from schemas.dataset_config import DatasetSpec
from schemas.media_ref import MediaRef
from schemas.reasons import Reason

MEDIA_TAG = re.compile(r"<image>|<video>")
KNOWN_ROLES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant", "system": "system"}


@register_reader("sharegpt")
@dataclass(frozen=True, slots=True)
class ShareGPTReader:
    """Reads ShareGPT records of one dataset spec."""

    spec: DatasetSpec

    def read(self, chunk: Chunk) -> Iterator[SourceRecord]:
        for raw in read_chunk(chunk):
            try:
                parsed: Conversation | RecordError = to_conversation(decode_record(raw), self.spec)
            except RecordError as exc:
                parsed = exc
            yield SourceRecord(source=chunk.source, line=raw.line, copies=raw.copies, parsed=parsed)


def to_conversation(record: object, spec: DatasetSpec) -> Conversation:
    """Validate a ShareGPT record and turn it into chat-template messages."""
    if not isinstance(record, dict):
        raise RecordError(Reason.BAD_RECORD, f"record must be a JSON object, got {type(record).__name__}")
    turns = record.get(spec.columns.messages)
    if not isinstance(turns, list) or not turns:
        raise RecordError(Reason.EMPTY_CONVERSATION, f"no turns in column {spec.columns.messages!r}")
    images = _media_list(record, spec.columns.images, spec, "image")
    videos = _media_list(record, spec.columns.videos, spec, "video")
    messages: list[Message] = []
    system = record.get(spec.columns.system)
    if isinstance(system, str) and system:
        messages.append({"role": "system", "content": system})
    media: list[MediaItem] = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise RecordError(Reason.BAD_RECORD, "every turn must be a JSON object")
        role, text = _role(turn, spec)
        if role != "user" and MEDIA_TAG.search(text):
            raise RecordError(Reason.MEDIA_TAG_MISMATCH, f"media tag in a {role} turn; tags belong in user turns")
        if role == "user" and MEDIA_TAG.search(text):
            messages.append({"role": role, "content": _split_media(text, images, videos, media)})
        else:
            messages.append({"role": role, "content": text})
    _check_all_used(media, images, videos)
    if not any(m["role"] == "assistant" for m in messages):
        raise RecordError(Reason.EMPTY_CONVERSATION, "no assistant turn: nothing to learn from")
    return Conversation(messages=messages, media=media)


def _media_list(record: dict[str, Any], column: str, spec: DatasetSpec, kind: MediaKind) -> list[MediaRef]:
    entries = record.get(column) or []
    if isinstance(entries, str):
        entries = [entries]
    if not isinstance(entries, list) or not all(isinstance(e, str) and e for e in entries):
        raise RecordError(Reason.BAD_RECORD, f"{column!r} must be a list of {kind} paths")
    return [_resolve(e, spec) for e in entries]


def _resolve(entry: str, spec: DatasetSpec) -> MediaRef:
    """The entry's reference with a normalised path (``/a/./b.jpg`` -> ``/a/b.jpg``), as stored."""
    ref = MediaRef.parse(entry, str(spec.media_dir))
    return replace(ref, path=str(PurePosixPath(ref.path)))


def _role(message: dict[str, Any], spec: DatasetSpec) -> tuple[str, str]:
    tags = spec.tags
    role = message.get(tags.role_tag, message.get("role", message.get("from")))
    content = message.get(tags.content_tag, message.get("content", message.get("value")))
    mapping = {tags.user_tag: "user", tags.assistant_tag: "assistant", tags.system_tag: "system"}
    resolved = (mapping.get(role) or KNOWN_ROLES.get(role)) if isinstance(role, str) else None
    if resolved is None:
        raise RecordError(Reason.BAD_ROLE, f"unknown role {role!r}")
    if not isinstance(content, str):
        raise RecordError(Reason.BAD_RECORD, f"content of a {resolved} turn must be a string")
    return resolved, content


def _split_media(
    text: str, images: list[MediaRef], videos: list[MediaRef], media: list[MediaItem]
) -> list[dict[str, str]]:
    """Content list for one user turn; consumes media refs in tag order."""
    items: list[dict[str, str]] = []
    pos = 0
    for match in MEDIA_TAG.finditer(text):
        if match.start() > pos:
            items.append({"type": "text", "text": text[pos : match.start()]})
        kind: MediaKind = "image" if match.group() == "<image>" else "video"
        pool = images if kind == "image" else videos
        used = sum(1 for m in media if m.kind == kind)
        if used >= len(pool):
            raise RecordError(Reason.MEDIA_TAG_MISMATCH, f"more <{kind}> tags than {kind}s ({len(pool)})")
        media.append(MediaItem(kind=kind, ref=pool[used]))
        items.append({"type": kind})
        pos = match.end()
    if pos < len(text):
        items.append({"type": "text", "text": text[pos:]})
    return items


def _check_all_used(media: list[MediaItem], images: list[MediaRef], videos: list[MediaRef]) -> None:
    for kind, pool in (("image", images), ("video", videos)):
        used = sum(1 for m in media if m.kind == kind)
        if used != len(pool):
            raise RecordError(Reason.MEDIA_TAG_MISMATCH, f"{used} <{kind}> tags but {len(pool)} {kind}s listed")
