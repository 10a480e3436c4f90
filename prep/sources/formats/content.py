"""Turn content -> chat-template content, shared by every reader: media tags, content lists.

Two spellings of a turn's content are accepted, mixed freely within a record:

- a string, where ``<image>`` / ``<video>`` tags (LLaMA-Factory's placeholders) take the next
  entry of the record's ``images`` / ``videos`` list, in order;
- a content list as Hugging Face chat templates and the OpenAI API take it:
  ``{"type": "text", "text": ...}``, ``{"type": "image" | "video"}`` (the next list entry),
  or an item carrying its own path under ``image`` / ``video`` / ``path`` / ``url``
  (``{"type": "image_url", "image_url": {"url": ...}}`` included).

A string with tags becomes a content list (``[{"type": "image"}, {"type": "text", ...}]``) so
the model's own template renders the placeholders; a string without tags stays a string; a
content list stays a list with media items reduced to ``{"type": kind}`` (the path travels in
:class:`~prep.sources.conversation.MediaItem`, in placeholder order). Every list entry must
be used exactly once: a count that differs is an error, never a silent fix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import PurePosixPath
from typing import Any

from prep.sources.conversation import MediaItem, MediaKind
from prep.sources.errors import RecordError
from schemas.dataset_config import DatasetSpec
from schemas.media_ref import MediaRef
from schemas.reasons import Reason

MEDIA_TAG = re.compile(r"<image>|<video>")
PATH_KEYS = ("image", "video", "path", "url")
KIND_OF_TYPE: dict[str, MediaKind] = {"image": "image", "image_url": "image", "video": "video", "video_url": "video"}


def media_list(record: dict[str, Any], column: str | None, spec: DatasetSpec, kind: MediaKind) -> list[MediaRef]:
    """The record's ``images`` / ``videos`` entries as references (relative to ``media_dir``)."""
    entries = record.get(column) if column else None
    entries = entries or []
    if isinstance(entries, str):
        entries = [entries]
    if not isinstance(entries, list) or not all(isinstance(e, str) and e for e in entries):
        raise RecordError(Reason.BAD_RECORD, f"{column!r} must be a list of {kind} paths")
    return [resolve(e, spec) for e in entries]


def resolve(entry: str, spec: DatasetSpec) -> MediaRef:
    """The entry's reference with a normalised path (``/a/./b.jpg`` -> ``/a/b.jpg``), as stored."""
    if entry.startswith(("http://", "https://", "data:")):
        raise RecordError(
            Reason.BAD_RECORD, f"media {entry[:60]!r}: remote or inline media is not read; store it as a file"
        )
    ref = MediaRef.parse(entry, str(spec.media_dir))
    return replace(ref, path=str(PurePosixPath(ref.path)))


@dataclass(slots=True)
class MediaCursor:
    """The record's media lists and the items taken so far, in placeholder order."""

    spec: DatasetSpec
    images: list[MediaRef]
    videos: list[MediaRef]
    media: list[MediaItem] = field(default_factory=list)
    _taken: dict[str, int] = field(default_factory=lambda: {"image": 0, "video": 0})

    def take(self, kind: MediaKind) -> None:
        """Use the next entry of the record's list of ``kind``."""
        pool = self.images if kind == "image" else self.videos
        if self._taken[kind] >= len(pool):
            raise RecordError(Reason.MEDIA_TAG_MISMATCH, f"more <{kind}> tags than {kind}s ({len(pool)})")
        self.media.append(MediaItem(kind=kind, ref=pool[self._taken[kind]]))
        self._taken[kind] += 1

    def content(self, role: str, content: object) -> str | list[dict[str, str]]:
        """Chat-template content of one turn (see the module docstring)."""
        if isinstance(content, str):
            if not MEDIA_TAG.search(content):
                return content
            _media_allowed(role)
            return self._split(content)
        if not isinstance(content, list) or not content:
            raise RecordError(Reason.BAD_RECORD, f"content of a {role} turn must be a string or a content list")
        items: list[dict[str, str]] = []
        for item in content:
            items.extend(self._item(role, item))
        return items

    def check_all_used(self) -> None:
        for kind, pool in (("image", self.images), ("video", self.videos)):
            if self._taken[kind] != len(pool):
                raise RecordError(
                    Reason.MEDIA_TAG_MISMATCH, f"{self._taken[kind]} <{kind}> tags but {len(pool)} {kind}s listed"
                )

    def _split(self, text: str) -> list[dict[str, str]]:
        items: list[dict[str, str]] = []
        pos = 0
        for match in MEDIA_TAG.finditer(text):
            if match.start() > pos:
                items.append({"type": "text", "text": text[pos : match.start()]})
            kind: MediaKind = "image" if match.group() == "<image>" else "video"
            self.take(kind)
            items.append({"type": kind})
            pos = match.end()
        if pos < len(text):
            items.append({"type": "text", "text": text[pos:]})
        return items

    def _item(self, role: str, item: object) -> list[dict[str, str]]:
        if not isinstance(item, dict):
            raise RecordError(Reason.BAD_RECORD, f"content items of a {role} turn must be objects, got {item!r:.60}")
        kind_name = item.get("type")
        if kind_name == "text" or (kind_name is None and isinstance(item.get("text"), str)):
            text = item.get("text")
            if not isinstance(text, str):
                raise RecordError(Reason.BAD_RECORD, f"a text item of a {role} turn has no string 'text'")
            if MEDIA_TAG.search(text):
                _media_allowed(role)
                return self._split(text)
            return [{"type": "text", "text": text}]
        kind = KIND_OF_TYPE.get(kind_name) if isinstance(kind_name, str) else _kind_from_keys(item)
        if kind is None and kind_name in ("audio", "input_audio", "audio_url"):
            raise RecordError(Reason.UNSUPPORTED_MEDIA, f"{kind_name} items are not supported (images and videos are)")
        if kind is None:
            raise RecordError(Reason.BAD_RECORD, f"content item type {kind_name!r} unsupported (text, image, video)")
        _media_allowed(role)
        path = _item_path(item, kind)
        if path is None:
            self.take(kind)
        else:
            self.media.append(MediaItem(kind=kind, ref=resolve(path, self.spec)))
        return [{"type": kind}]


def _kind_from_keys(item: dict[str, Any]) -> MediaKind | None:
    """Items without ``type``, as the Qwen templates also accept them (``{"image": "a.jpg"}``)."""
    for key in ("image", "image_url", "video", "video_url"):
        if key in item:
            return KIND_OF_TYPE[key]
    return None


def _item_path(item: dict[str, Any], kind: MediaKind) -> str | None:
    """The item's own path, if it carries one (``image_url`` / ``video_url`` objects included)."""
    for key in (kind, f"{kind}_url", *PATH_KEYS):
        value = item.get(key)
        if isinstance(value, dict):
            value = value.get("url") or value.get("path")
        if isinstance(value, str) and value:
            return value
        if value is not None and not isinstance(value, str | dict):
            raise RecordError(Reason.BAD_RECORD, f"{kind} item key {key!r} must be a path string, got {value!r:.60}")
    return None


def _media_allowed(role: str) -> None:
    if role != "user":
        raise RecordError(Reason.MEDIA_TAG_MISMATCH, f"media tag in a {role} turn; tags belong in user turns")
