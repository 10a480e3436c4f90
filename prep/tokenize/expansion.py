"""Text-level media expansion: splice an item's expansion into the rendered text, then tokenize.

Some processors replace an image placeholder by *text* whose pieces merge with the text around
it in BPE (Gemma 3 wraps every image in ``"\\n\\n"``, Idefics3 puts newlines between tile rows,
GLM and InternVL write frame timestamps). Splicing ids after tokenizing would then differ from
the processor, so for those items the k-th placeholder token's text is replaced by the k-th
item's ``expansion_text`` first, exactly as the processors do (``text.replace(token, ...)``),
and the whole conversation is tokenized once. Assistant spans are moved with the text; the
expanded characters are recorded as media spans so the loss mask never covers them.

Example: ``"Look:<start_of_image>Cat"`` with expansion ``"\\n\\n<start_of_image>...\\n\\n"`` ->
``"Look:\\n\\n<start_of_image>...\\n\\nCat"``; an assistant span after it shifts by the growth.
"""

from __future__ import annotations

from dataclasses import replace

from packvlm.sample_error import SampleError
from prep.tokenize.template import RenderedText
from schemas.reasons import Reason


def expand_placeholders(rendered: RenderedText, placeholder: str, expansions: list[str], kind: str) -> RenderedText:
    """Replace the k-th ``placeholder`` occurrence by ``expansions[k]``; counts must match exactly."""
    starts = _occurrences(rendered.text, placeholder)
    if len(starts) != len(expansions):
        raise SampleError(
            Reason.MEDIA_TAG_MISMATCH,
            f"rendered text has {len(starts)} {kind} placeholder tokens for {len(expansions)} {kind}s "
            "(does the text spell a placeholder token?)",
        )
    if not starts:
        return rendered
    pieces: list[str] = []
    media: list[tuple[int, int]] = []
    prev = 0
    out_len = 0
    for start, expansion in zip(starts, expansions, strict=True):
        pieces.append(rendered.text[prev:start])
        out_len += start - prev
        media.append((out_len, out_len + len(expansion)))
        pieces.append(expansion)
        out_len += len(expansion)
        prev = start + len(placeholder)
    pieces.append(rendered.text[prev:])

    def moved(pos: int) -> int:
        """Where an old character position lands: shifted by every expansion before it."""
        growth = sum(len(e) - len(placeholder) for s, e in zip(starts, expansions, strict=True) if s < pos)
        return pos + growth

    spans = [(moved(start), moved(end)) for start, end in rendered.assistant_spans]
    return replace(rendered, text="".join(pieces), assistant_spans=spans, media_spans=(*rendered.media_spans, *media))


def _occurrences(text: str, token: str) -> list[int]:
    """Start of every non-overlapping occurrence, left to right (as ``str.replace`` sees them)."""
    starts = []
    pos = text.find(token)
    while pos != -1:
        starts.append(pos)
        pos = text.find(token, pos + len(token))
    return starts
