"""What every reader produces, whatever the input format: chat messages plus their media.

A user turn with media is a content list (``[{"type": "text", "text": ...}, {"type":
"image"}, ...]``) so the model's own chat template renders the placeholders; every other
turn's content is a plain string (or the record's own content list). An assistant turn
that calls tools carries ``tool_calls`` and tool answers are ``tool`` turns; ``tools`` holds the
function definitions, passed to the template as ``apply_chat_template(tools=...)`` takes them.
``media`` lists the items in placeholder order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from schemas.media import MediaKind
from schemas.media_ref import MediaRef

Message = dict[str, Any]  # {"role": ..., "content": str | list of content parts}: apply_chat_template's input


@dataclass(frozen=True, kw_only=True, slots=True)
class MediaItem:
    kind: MediaKind
    ref: MediaRef


@dataclass(frozen=True, kw_only=True, slots=True)
class Conversation:
    """Messages (and tools) ready for ``apply_chat_template``, media in placeholder order."""

    messages: list[Message]
    media: list[MediaItem]
    tools: list[dict[str, Any]] | None = None
