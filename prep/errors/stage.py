"""`prep errors` stage: a tokenize or pack output -> why its rows were lost, as text or JSON.

Inputs: ``DIR/manifest.json`` (a `TokenizeManifest` or a `PackManifest`) and, for a
tokenized dir, the ``errors/`` parts the manifest counts (memory-mapped, see
:mod:`prep.errors.core` for which columns are read). Outputs: an `ErrorsReport` (tokenize:
error rows grouped by reason) or an `OversizeReport` (pack: samples over the pack size).
Invariants: nothing is written; without ``--dataset`` the counts are the manifest's and the
parts are opened only until ``limit`` examples of every selected reason are found. Example::

    DIR = tok/ (manifest errors_by_reason {"corrupt_image": 3, "bad_role": 1}), limit 1
    -> reasons: corrupt_image 3 [chat:41:0 .../chat.jsonl:41 "...: not a recognised image format"]
                bad_role      1 [chat:24:0 .../chat.jsonl:24 "unknown role 'robot'"]
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from packvlm.errors import UsageError
from prep.errors.core import (
    ErrorExample,
    ErrorsReport,
    OversizeExample,
    OversizeReport,
    count_reasons,
    examples_at,
    first_rows,
    format_summary,
    group_reasons,
    row_mask,
)
from schemas.layout import ERRORS_DIR, MANIFEST_FILE, part_name
from schemas.manifest import PackManifest, TokenizeManifest, read_any_manifest
from schemas.reasons import Reason
from schemas.stages import Stage
from schemas.tokenized import list_parts, open_part

DEFAULT_LIMIT = 5


class ErrorsQueryError(UsageError, ValueError):
    """An option that does not fit the directory (unknown dataset, filters on a pack output)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ErrorsConfig:
    """Every option of `prep errors`.

    Attributes:
        input_dir: Output directory of `prep tokenize` or `prep pack`.
        reasons: Only these reasons (tokenize outputs); empty means all.
        datasets: Only these datasets (tokenize outputs); empty means all.
        limit: Examples per reason (oversize samples for a pack output); 0 prints counts only.
    """

    input_dir: str
    reasons: tuple[Reason, ...] = ()
    datasets: tuple[str, ...] = ()
    limit: int = DEFAULT_LIMIT


def read_errors(config: ErrorsConfig) -> ErrorsReport | OversizeReport:
    """The report for whichever stage wrote ``config.input_dir``.

    Raises:
        ManifestError: ``input_dir`` is not a finished tokenize or pack output.
        ErrorsQueryError: A filter names an unknown dataset, or filters a pack output.
        TokenizedPartError: An errors part the manifest counts is missing or unreadable.
    """
    if config.limit < 0:
        raise ErrorsQueryError(f"--limit must be >= 0, got {config.limit}")
    root = Path(config.input_dir)
    manifest = read_any_manifest(root / MANIFEST_FILE, (TokenizeManifest, PackManifest))
    if isinstance(manifest, TokenizeManifest):
        return _errors_report(root, manifest, config)
    if config.reasons or config.datasets:
        raise ErrorsQueryError(
            f"{root} is a `prep pack` output: it has oversize samples, not error rows; "
            "--reason and --dataset apply to a `prep tokenize` output"
        )
    return _oversize_report(root, cast(PackManifest, manifest), config.limit)


def _oversize_report(root: Path, manifest: PackManifest, limit: int) -> OversizeReport:
    examples = tuple(
        OversizeExample(sample_id=o.sample_id, num_tokens=o.num_tokens, input=manifest.inputs[o.input].path)
        for o in manifest.oversize[:limit]
    )
    return OversizeReport(
        stage=Stage.PACK.value,
        directory=str(root),
        pack_size=manifest.pack_size,
        samples=manifest.samples.total,
        oversize=len(manifest.oversize),
        examples=examples,
    )


def _errors_report(root: Path, manifest: TokenizeManifest, config: ErrorsConfig) -> ErrorsReport:
    unknown = sorted(set(config.datasets) - set(manifest.per_dataset))
    if unknown:
        raise ErrorsQueryError(
            f"--dataset {', '.join(unknown)}: not in {root} (datasets: {', '.join(sorted(manifest.per_dataset))})"
        )
    reasons = tuple(r.value for r in config.reasons)
    parts = [root / ERRORS_DIR / part_name(i) for i in range(manifest.inputs.chunks)]
    known_counts = None if config.datasets else _selected(manifest.errors_by_reason, reasons)
    counts, examples = collect(parts, reasons, config.datasets, config.limit, known_counts)
    scope = [manifest.per_dataset[d] for d in config.datasets] if config.datasets else [manifest.rows]
    return ErrorsReport(
        stage=Stage.TOKENIZE.value,
        directory=str(root),
        datasets=config.datasets,
        rows=sum(c.samples + c.errors for c in scope),
        errors=sum(c.errors for c in scope),
        reasons=group_reasons(counts, examples, keep_zero=reasons),
    )


def _selected(counts: Mapping[str, int], reasons: Iterable[str]) -> dict[str, int]:
    wanted = set(reasons)
    return {r: c for r, c in counts.items() if not wanted or r in wanted}


def collect(
    parts: list[Path],
    reasons: tuple[str, ...],
    datasets: tuple[str, ...],
    limit: int,
    counts: Mapping[str, int] | None = None,
) -> tuple[dict[str, int], dict[str, list[ErrorExample]]]:
    """Counts per reason and the first ``limit`` examples of each, in part order.

    With ``counts`` given (the manifest's), parts are opened only until every counted
    reason has its examples; without, every part's ``reason`` column is read to count.
    """
    tally: Counter[str] = Counter()
    examples: dict[str, list[ErrorExample]] = {}
    for path in parts:
        if counts is not None:
            need = {r: min(limit, c) - len(examples.get(r, ())) for r, c in counts.items()}
            if not any(n > 0 for n in need.values()):
                break
        table = open_part(path)
        mask = row_mask(table, reasons, datasets)
        if counts is None:
            part_counts = count_reasons(table, mask)
            tally.update(part_counts)
            need = {r: limit - len(examples.get(r, ())) for r in part_counts}
        for reason, indices in first_rows(table, mask, need).items():
            examples.setdefault(reason, []).extend(examples_at(table, indices))
    return (dict(counts) if counts is not None else dict(tally)), examples


def error_summary(out_dir: str | Path, limit: int = 3, *, datasets: tuple[str, ...] = ()) -> str:
    """Per-reason counts of a tokenize output with one example each, for a failure message.

    Reads the ``errors/`` parts on disk (no manifest needed, so it works before or after the
    manifest is written). Shows the ``limit`` most frequent reasons with an example; the
    others by count only. ``datasets`` narrows it to the datasets over budget.
    """
    root = Path(out_dir)
    counts, examples = collect(list_parts(root, ERRORS_DIR), (), datasets, 1)
    firsts = {r: e[:1] for r, e in examples.items()}
    groups = group_reasons(counts, firsts)
    command = " ".join(["prep errors", str(root), *(f"--dataset {d}" for d in datasets)])
    return format_summary(groups, sum(counts.values()), limit, command)
