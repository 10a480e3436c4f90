"""Numbers users care about, computed from the parts on disk (so resumed runs agree)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.compute as pc

from schemas.layout import ERRORS_DIR, SAMPLES_DIR, part_name
from schemas.manifest import RowCounts, TokenizeManifest, TokenTotals, VerifyCounts
from schemas.tokenized import open_part


@dataclass(frozen=True, kw_only=True, slots=True)
class OutputSummary:
    """The manifest sections computed from the parts."""

    rows: RowCounts
    per_dataset: dict[str, RowCounts]
    errors_by_reason: dict[str, int]
    tokens: TokenTotals
    verify: VerifyCounts


def summarize_output(out: Path, chunk_indices: list[int], datasets: tuple[str, ...] = ()) -> OutputSummary:
    """Row counts, token totals, errors by reason and verification tallies over all parts.

    Every name in ``datasets`` gets a row, so a dataset that yielded no row at all (an empty
    file) stays in the manifest and the table instead of vanishing.
    """
    per_dataset: dict[str, Counter[str]] = {name: Counter() for name in datasets}
    reasons: Counter[str] = Counter()
    totals: Counter[str] = Counter()
    verified = skipped = 0
    longest = 0
    for index in chunk_indices:
        samples = open_part(out / SAMPLES_DIR / part_name(index))
        errors = open_part(out / ERRORS_DIR / part_name(index))
        meta = samples.schema.metadata or {}
        verified += int(meta.get(b"verified", b"0"))
        skipped += int(meta.get(b"verify_skipped", b"0"))
        for column in ("num_tokens", "num_text_tokens", "num_media_tokens"):
            totals[column] += int(pc.sum(samples.column(column)).as_py() or 0)
        if samples.num_rows:
            longest = max(longest, int(pc.max(samples.column("num_tokens")).as_py()))
        for table, key in ((samples, "samples"), (errors, "errors")):
            for dataset, count in Counter(table.column("dataset").to_pylist()).items():
                per_dataset.setdefault(dataset, Counter())[key] += count
        reasons.update(errors.column("reason").to_pylist())
    num_samples = sum(c["samples"] for c in per_dataset.values())
    num_errors = sum(c["errors"] for c in per_dataset.values())
    return OutputSummary(
        rows=RowCounts(samples=num_samples, errors=num_errors),
        per_dataset={k: RowCounts(samples=v["samples"], errors=v["errors"]) for k, v in sorted(per_dataset.items())},
        errors_by_reason=dict(sorted(reasons.items())),
        tokens=TokenTotals(
            total=totals["num_tokens"],
            text=totals["num_text_tokens"],
            media=totals["num_media_tokens"],
            max_sample=longest,
            mean_sample=round(totals["num_tokens"] / num_samples, 2) if num_samples else 0.0,
        ),
        verify=VerifyCounts(checked=verified, skipped_no_reference=skipped),
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class ReasonExample:
    """How often a reason hit one dataset, and its first row (sample_id + message)."""

    reason: str
    count: int
    sample_id: str
    message: str


@dataclass(kw_only=True, slots=True)
class _Tally:
    counts: Counter[str] = field(default_factory=Counter)
    first: dict[str, tuple[str, str]] = field(default_factory=dict)


def error_examples(out: Path, datasets: set[str], top: int = 3) -> dict[str, list[ReasonExample]]:
    """Each named dataset's ``top`` error reasons, most frequent first, with an example row each."""
    tallies = {name: _Tally() for name in datasets}
    for part in sorted((out / ERRORS_DIR).glob("part-*.arrow")):
        table = open_part(part).select(["sample_id", "dataset", "reason", "message"])
        for row in table.to_pylist():
            tally = tallies.get(row["dataset"])
            if tally is not None:
                tally.counts[row["reason"]] += 1
                tally.first.setdefault(row["reason"], (row["sample_id"], row["message"]))
    return {
        name: [
            ReasonExample(reason=r, count=n, sample_id=t.first[r][0], message=t.first[r][1])
            for r, n in sorted(t.counts.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
        ]
        for name, t in tallies.items()
    }


def format_dataset_table(manifest: TokenizeManifest) -> str:
    """Rows, errors and error rate of every dataset, one line each."""
    width = max([len("dataset"), *(len(n) for n in manifest.per_dataset)])
    lines = [f"  {'dataset':<{width}}  {'samples':>9}  {'errors':>9}  {'error rate':>10}"]
    for name, rows in manifest.per_dataset.items():
        total = rows.samples + rows.errors
        rate = rows.errors / total if total else 0.0
        lines.append(f"  {name:<{width}}  {rows.samples:>9,}  {rows.errors:>9,}  {rate:>10.1%}")
    return "\n".join(lines)


def format_summary(manifest: TokenizeManifest) -> str:
    """Human-readable end-of-run report."""
    rows, tokens = manifest.rows, manifest.tokens
    lines = [
        f"samples: {rows.samples:,}   errors: {rows.errors:,}   (input rows used: {manifest.inputs.rows_used:,})",
        f"tokens: {tokens.total:,} total = {tokens.text:,} text + {tokens.media:,} media;"
        f" longest sample {tokens.max_sample:,}, mean {tokens.mean_sample:,}",
        _verify_line(manifest),
    ]
    for reason, count in manifest.errors_by_reason.items():
        lines.append(f"  error {reason}: {count:,}")
    lines += ["per dataset:", format_dataset_table(manifest)]
    return "\n".join(lines)


def _verify_line(manifest: TokenizeManifest) -> str:
    """Verification is per record: sample_ratio copies share their record's ids, so say what the rest are."""
    verify, samples = manifest.verify, manifest.rows.samples
    line = f"verified against the processor: {verify.checked:,} of {samples:,} samples"
    notes = []
    if verify.skipped_no_reference:
        notes.append(
            f"{verify.skipped_no_reference:,} drawn but skipped: no reference processor here (videos need torchvision)"
        )
    rest = samples - verify.checked - verify.skipped_no_reference
    if rest > 0:
        notes.append(f"{rest:,} not drawn by --verify-fraction or sample_ratio copies of a checked record (same ids)")
    return line + (f" ({'; '.join(notes)})" if notes else "")
