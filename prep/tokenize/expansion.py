"""Text-level media expansion: splice an item's expansion into the rendered text, then tokenize.

Some processors replace an image placeholder by *text* whose pieces merge with the text around
it in BPE (Gemma 3 wraps every image in ``"\\n\\n"``, Idefics3 puts newlines between tile rows,
GLM and InternVL write frame timestamps). Splicing ids after tokenizing would then differ from
the processor, so for those items the k-th placeholder token's text is replaced by the k-th
item's expansion text first, exactly as the processors do (``text.replace(token, ...)``),
and the whole conversation is tokenized once. Assistant spans are moved with the text; the
expanded characters are recorded as media spans so the loss mask never covers them. The
result (`ExpandedText`) keeps the expansions' declared runs of one token (`families.run_text`):
the tokenizer (`prep.tokenize.runs`) cuts them without building or searching the whole text.

Example: ``"Look:<start_of_image>Cat"`` with expansion ``"\\n\\n<start_of_image>...\\n\\n"`` ->
``"Look:\\n\\n<start_of_image>...\\n\\nCat"``; an assistant span after it shifts by the growth.
"""

from __future__ import annotations

from dataclasses import dataclass

from families.run_text import RunText
from packvlm.sample_error import SampleError
from prep.tokenize.template import RenderedText
from schemas.reasons import Reason


@dataclass(frozen=True, kw_only=True, slots=True)
class ExpandedText:
    """A rendered text with its text-level media expansions in, as literal pieces and runs."""

    pieces: RunText  # the whole text
    assistant_spans: list[tuple[int, int]]  # character [start, end) of each assistant turn
    media_spans: tuple[tuple[int, int], ...]  # the expansions (and any media spans before)

    @property
    def text(self) -> str:
        """The whole text (built on each call)."""
        return self.pieces.text

    def rendered(self) -> RenderedText:
        """The same as a `RenderedText`, its text written out."""
        return RenderedText(text=self.text, assistant_spans=self.assistant_spans, media_spans=self.media_spans)


def expand_placeholders(
    rendered: RenderedText | ExpandedText, placeholder: str, expansions: list[RunText], kind: str
) -> ExpandedText:
    """Replace the k-th ``placeholder`` occurrence by ``expansions[k]``; counts must match exactly.

    An already expanded text (a second kind) is written out first: its placeholders are looked for
    in the whole text, inside the first kind's expansions too, as the processors' ``replace`` does."""
    if isinstance(rendered, ExpandedText):
        rendered = rendered.rendered()
    text = rendered.text
    starts = _occurrences(text, placeholder)
    if len(starts) != len(expansions):
        raise SampleError(
            Reason.MEDIA_TAG_MISMATCH,
            f"rendered text has {len(starts)} {kind} placeholder tokens for {len(expansions)} {kind}s "
            "(does the text spell a placeholder token?)",
        )
    pieces: list[str | RunText] = []
    media: list[tuple[int, int]] = []
    prev = 0
    out_len = 0
    for start, expansion in zip(starts, expansions, strict=True):
        pieces.append(text[prev:start])
        out_len += start - prev
        media.append((out_len, out_len + expansion.num_chars))
        pieces.append(expansion)
        out_len += expansion.num_chars
        prev = start + len(placeholder)
    pieces.append(text[prev:])

    def moved(pos: int) -> int:
        """Where an old character position lands: shifted by every expansion before it."""
        growth = sum(e.num_chars - len(placeholder) for s, e in zip(starts, expansions, strict=True) if s < pos)
        return pos + growth

    spans = [(moved(start), moved(end)) for start, end in rendered.assistant_spans]
    before = tuple((moved(start), moved(end)) for start, end in rendered.media_spans)  # a first kind's
    return ExpandedText(pieces=RunText.of(pieces), assistant_spans=spans, media_spans=(*before, *media))


def _occurrences(text: str, token: str) -> list[int]:
    """Start of every non-overlapping occurrence, left to right (as ``str.replace`` sees them)."""
    starts = []
    pos = text.find(token)
    while pos != -1:
        starts.append(pos)
        pos = text.find(token, pos + len(token))
    return starts
