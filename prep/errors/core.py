"""Pure functions of `prep errors`: pick error rows from Arrow tables, group them, format them.

Only the columns a step needs are touched: ``reason`` (and ``dataset`` when filtering) to
count and to find example rows, then the printed columns of just those rows. Example::

    errors part rows      reason           dataset  -> counts {"corrupt_image": 2, "bad_role": 1}
    0  chat:41:0          corrupt_image    chat        examples (limit 1):
    1  chat:45:0          corrupt_image    chat          corrupt_image -> [row 0]
    2  chat:24:0          bad_role         chat          bad_role      -> [row 2]
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

MESSAGE_CHARS = 240  # text output cuts longer messages; --json keeps them whole
EXAMPLE_COLUMNS = ("sample_id", "dataset", "source", "line", "copy", "message")


@dataclass(frozen=True, kw_only=True, slots=True)
class ErrorExample:
    """One error row as printed: where the input row is and why it failed."""

    sample_id: str
    dataset: str
    source: str
    line: int  # 0-based index of the record in its file, as in the errors table
    copy: int
    message: str


@dataclass(frozen=True, kw_only=True, slots=True)
class ReasonGroup:
    """All error rows of one reason: their count and the first few, in part order."""

    reason: str
    count: int
    examples: tuple[ErrorExample, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class ErrorsReport:
    """Error rows of a `prep tokenize` output, grouped by reason, most frequent first."""

    stage: str  # "tokenize"
    directory: str
    datasets: tuple[str, ...]  # the --dataset filter; empty means all
    rows: int  # input rows (samples + errors) in scope
    errors: int  # error rows in scope, all reasons
    reasons: tuple[ReasonGroup, ...]  # only the selected reasons


@dataclass(frozen=True, kw_only=True, slots=True)
class OversizeExample:
    """A sample `prep pack` left out because its slot exceeds the pack size."""

    sample_id: str
    num_tokens: int
    input: str  # the tokenized directory it came from


@dataclass(frozen=True, kw_only=True, slots=True)
class OversizeReport:
    """The oversize samples of a `prep pack` output (its only per-sample losses)."""

    stage: str  # "pack"
    directory: str
    pack_size: int
    samples: int  # tokenized samples over all inputs
    oversize: int
    examples: tuple[OversizeExample, ...]


def row_mask(table: pa.Table, reasons: Sequence[str], datasets: Sequence[str]) -> pa.ChunkedArray | None:
    """Rows that pass the ``--reason`` / ``--dataset`` filters; None when nothing is filtered."""
    mask = None
    if reasons:
        mask = pc.is_in(table.column("reason"), value_set=pa.array(list(reasons), pa.string()))
    if datasets:
        in_datasets = pc.is_in(table.column("dataset"), value_set=pa.array(list(datasets), pa.string()))
        mask = in_datasets if mask is None else pc.and_(mask, in_datasets)
    return mask


def count_reasons(table: pa.Table, mask: pa.ChunkedArray | None) -> Counter[str]:
    """Error rows per reason among the rows ``mask`` keeps (reads the ``reason`` column only)."""
    reasons = table.column("reason")
    if mask is not None:
        reasons = reasons.filter(mask)
    return Counter({str(v["values"]): int(v["counts"]) for v in pc.value_counts(reasons).to_pylist()})


def first_rows(table: pa.Table, mask: pa.ChunkedArray | None, need: Mapping[str, int]) -> dict[str, list[int]]:
    """Indices of the first ``need[reason]`` rows of each reason that ``mask`` keeps."""
    out: dict[str, list[int]] = {}
    reasons = table.column("reason")
    for reason, count in need.items():
        if count <= 0:
            continue
        hit = pc.equal(reasons, reason)
        if mask is not None:
            hit = pc.and_(hit, mask)
        indices = pc.indices_nonzero(pc.fill_null(hit, False))[:count].to_pylist()
        if indices:
            out[reason] = [int(i) for i in indices]
    return out


def examples_at(table: pa.Table, indices: Sequence[int]) -> list[ErrorExample]:
    """The printed columns of the given rows only (memory-mapped parts stay untouched elsewhere)."""
    if not indices:
        return []
    rows = table.select(list(EXAMPLE_COLUMNS)).take(pa.array(indices, pa.int64())).to_pylist()
    return [ErrorExample(**row) for row in rows]


def group_reasons(
    counts: Mapping[str, int], examples: Mapping[str, Sequence[ErrorExample]], keep_zero: Iterable[str] = ()
) -> tuple[ReasonGroup, ...]:
    """Groups most frequent first (ties by name); ``keep_zero`` reasons are listed even at 0."""
    names = {r for r, c in counts.items() if c > 0} | set(keep_zero)
    ordered = sorted(names, key=lambda r: (-counts.get(r, 0), r))
    return tuple(ReasonGroup(reason=r, count=counts.get(r, 0), examples=tuple(examples.get(r, ()))) for r in ordered)


def _one_line(text: str, limit: int = MESSAGE_CHARS) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _percent(part: int, whole: int) -> str:
    return f"{part / whole:.1%}" if whole else "0.0%"


def format_example(example: ErrorExample) -> str:
    """``sample_id  source:line  message`` on one line."""
    return f"{example.sample_id}  {example.source}:{example.line}  {_one_line(example.message)}"


def format_errors(report: ErrorsReport) -> str:
    """Terminal text: a header with totals, then each reason with its count and examples."""
    scope = f" of datasets {', '.join(report.datasets)}" if report.datasets else ""
    lines = [
        f"{report.errors:,} error rows in {report.rows:,} input rows{scope} "
        f"({_percent(report.errors, report.rows)}) in {report.directory}"
    ]
    if not report.reasons:
        lines.append("no error rows match" if report.errors else "no error rows")
    for group in report.reasons:
        rows = "row" if group.count == 1 else "rows"
        gap = "\n" if group.examples else ""
        lines.append(f"{gap}{group.reason}: {group.count:,} {rows} ({_percent(group.count, report.errors)} of errors)")
        lines.extend(f"  {format_example(e)}" for e in group.examples)
        if group.count > len(group.examples) and group.examples:
            lines.append(f"  ... {group.count - len(group.examples):,} more (--limit N shows more)")
    if any(g.examples for g in report.reasons):
        lines.append("\n(source:line = 0-based record index in its file; --json gives full messages)")
    return "\n".join(lines)


def format_oversize(report: OversizeReport) -> str:
    """Terminal text: how many samples did not fit, then the first few with their token counts."""
    lines = [
        f"{report.oversize:,} of {report.samples:,} samples exceed --pack-size {report.pack_size:,} "
        f"({_percent(report.oversize, report.samples)}) and are in no pack of {report.directory}"
    ]
    inputs = {e.input for e in report.examples}
    for e in report.examples:
        where = f"  (input {e.input})" if len(inputs) > 1 else ""
        lines.append(f"  {e.sample_id}  {e.num_tokens:,} tokens{where}")
    if report.oversize > len(report.examples) and report.examples:
        lines.append(f"  ... {report.oversize - len(report.examples):,} more (--limit N shows more)")
    return "\n".join(lines)


def format_summary(groups: Sequence[ReasonGroup], total: int, limit: int, command: str) -> str:
    """A few lines for a failure message: the ``limit`` top reasons with one example each."""
    if not total:
        return f"no error rows (`{command}`)"
    lines = [f"{total:,} error rows by reason (all of them: `{command}`):"]
    for group in groups[:limit]:
        example = f": e.g. {format_example(group.examples[0])}" if group.examples else ""
        lines.append(f"  {group.reason} {group.count:,}{example}")
    rest = groups[limit:]
    if rest:
        lines.append("  and " + ", ".join(f"{g.reason} {g.count:,}" for g in rest))
    return "\n".join(lines)
