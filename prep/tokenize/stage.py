"""`prep tokenize` stage: dataset config -> tokenized parts + errors + manifest.

Inputs: a dataset config (:mod:`schemas.dataset_config`) and a processor. Outputs, in
``OUT``: ``samples/part-NNNNNN.arrow`` and ``errors/part-NNNNNN.arrow`` (one pair per input
chunk, :mod:`schemas.tokenized`) and ``manifest.json`` (:mod:`schemas.manifest`).

Invariants: every used (record, copy) is exactly one samples row or one errors row (checked
at the end); parts are written to temp names and renamed, so a killed run re-run with the
same arguments redoes only missing chunks and ends byte-identical to an uninterrupted one;
the manifest is computed from the parts on disk, never from in-memory tallies.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from packvlm.atomic import write_arrow_atomic, write_json_atomic
from packvlm.errors import DataBudgetError, InternalError, UsageError
from packvlm.faults import crash_point
from packvlm.output_dir import claim_output_dir, file_fingerprint
from prep.run import ExecutorConfig, run_tasks
from prep.sources.media import DECODE_LIMIT_PIXELS
from prep.sources.records import Chunk, plan_chunks
from schemas.dataset_config import DatasetSpec, log_skipped, read_dataset_config, spec_to_json
from schemas.layout import ERRORS_DIR, MANIFEST_FILE, SAMPLES_DIR, part_name
from schemas.manifest import ProcessorIdentity, TokenizeInputs, TokenizeManifest
from schemas.stages import Stage

log = logging.getLogger(__name__)


class ConservationError(InternalError):
    """Rows were lost or duplicated between input and output: a bug, never ignored."""


class ErrorRateExceeded(DataBudgetError):
    """More per-sample errors than --max-error-rate allows (outputs are still written)."""


class OutputDirConflict(UsageError):
    """The output directory holds a different run."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenizeConfig:
    """Every option of `prep tokenize`; the defaults live here only. ``executor`` never shapes the output."""

    dataset_config: str
    processor: str
    output_dir: str
    datasets: tuple[str, ...] = ()
    max_length: int | None = None
    verify_fraction: float = 0.0
    seed: int = 0
    rows_per_chunk: int = 512
    max_error_rate: float = 0.05  # per dataset: a run that loses more fails (its outputs are kept)
    max_image_pixels: int = DECODE_LIMIT_PIXELS  # larger images are image_too_large rows (never reach train)
    media_roots: tuple[str, ...] = ()  # media resolving outside all of these are media_outside_root rows
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)

    def output_fields(self) -> dict[str, Any]:
        """The options the output depends on (written to the manifest and the resume check)."""
        keep = (
            "dataset_config",
            "processor",
            "datasets",
            "max_length",
            "verify_fraction",
            "seed",
            "rows_per_chunk",
            "max_image_pixels",
            "media_roots",
        )
        out = {k: v for k, v in asdict(self).items() if k in keep}
        out["dataset_config"] = str(Path(self.dataset_config).resolve())
        out["datasets"] = list(self.datasets)
        out["media_roots"] = [os.path.realpath(r) for r in self.media_roots]
        return out


class TokenizeWorker:
    """Built once per process/actor from JSON-safe kwargs; tokenizes whole chunks into parts."""

    def __init__(self, config_json: str, specs_json: str) -> None:
        from families.processor import load_processor_once
        from prep.tokenize.core import SampleTokenizer

        config = json.loads(config_json)
        self.out = Path(config["output_dir"])
        self.specs = {s["name"]: _spec_from_json(s) for s in json.loads(specs_json)}
        self.tokenizer = SampleTokenizer(
            load_processor_once(config["processor"]),  # in-process: the bundle the up-front check loaded
            max_length=config["max_length"],
            max_image_pixels=int(config["max_image_pixels"]),
            media_roots=tuple(config["media_roots"]),
        )
        self.verify_fraction = float(config["verify_fraction"])
        self.seed = int(config["seed"])

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        from prep.tokenize.chunk import VerifyPolicy, process_chunk

        stats: dict[str, list] = {"index": [], "samples": [], "errors": []}
        for task in batch["task"]:
            chunk = Chunk(**{**json.loads(task), "copies": tuple(json.loads(task)["copies"])})
            policy = VerifyPolicy(fraction=self.verify_fraction, seed=self.seed)
            result = process_chunk(chunk, self.specs[chunk.dataset], self.tokenizer, policy)
            meta = {"verified": str(result.verified), "verify_skipped": str(result.verify_skipped)}
            _write_part(self.out / ERRORS_DIR, chunk.index, result.errors, {})
            _write_part(self.out / SAMPLES_DIR, chunk.index, result.samples, meta)
            crash_point("tokenize.after_part")
            stats["index"].append(chunk.index)
            stats["samples"].append(result.samples.num_rows)
            stats["errors"].append(result.errors.num_rows)
        return stats


def _spec_from_json(raw: dict[str, Any]) -> DatasetSpec:
    from schemas.dataset_config import Columns, Tags, VideoSampling

    return DatasetSpec(
        **{
            **raw,
            "file_name": Path(raw["file_name"]),
            "media_dir": Path(raw["media_dir"]),
            "media_roots": tuple(Path(p) for p in raw["media_roots"]),
            "columns": Columns(**raw["columns"]),
            "tags": Tags(**raw["tags"]),
            "video": VideoSampling(**raw["video"]),
        }
    )


def _write_part(folder: Path, index: int, table: pa.Table, metadata: dict[str, str]) -> None:
    """Arrow IPC file via temp + rename: a part either exists whole or not at all."""
    table = table.replace_schema_metadata(
        {**(table.schema.metadata or {}), **{k.encode(): v.encode() for k, v in metadata.items()}}
    )
    write_arrow_atomic(folder / part_name(index), table)


def run_identity(config: TokenizeConfig, specs: list[DatasetSpec], processor: ProcessorIdentity) -> dict[str, Any]:
    """What a run's output depends on, by content: a rerun resumes only when all of it is equal.

    The processor is its class + files' sha256 (not the path given), the dataset config its
    sha256, each data file its size + head/tail hash; paths are resolved, so equivalent
    spellings resume while a changed file or another processor at the same path is refused.
    """
    options = {k: v for k, v in config.output_fields().items() if k not in ("processor", "dataset_config")}
    return {
        "options": options,
        "processor": {"class": processor.class_name, "sha256": processor.sha256},
        "dataset_config": {
            "path": str(Path(config.dataset_config).resolve()),
            **file_fingerprint(config.dataset_config),
        },
        "data_files": {spec.name: _data_fingerprint(spec) for spec in specs},
    }


def _data_fingerprint(spec: DatasetSpec) -> dict[str, Any]:
    """`file_fingerprint` of a local data file; for ``cloud_file_name`` its objects' sizes and ETags
    (listing metadata, no download; a local ``open`` of the URL failed every cloud run)."""
    if spec.cloud_file_name is None:
        return file_fingerprint(spec.file_name)
    from prep.sources.files import cloud_url, filesystem

    fs, url = filesystem(spec.cloud_file_name), cloud_url(spec.cloud_file_name)
    infos = [fs.info(p) for p in sorted(fs.find(url))] if fs.isdir(url) else [fs.info(url)]
    return {"size": sum(int(i.get("size", 0)) for i in infos), "etags": [str(i.get("ETag", "")) for i in infos]}


def _done(out: Path, chunk: Chunk) -> bool:
    return (out / SAMPLES_DIR / part_name(chunk.index)).exists() and (
        out / ERRORS_DIR / part_name(chunk.index)
    ).exists()


def _chunk_json(chunk: Chunk) -> str:
    return json.dumps(asdict(chunk), sort_keys=True)


def run_tokenize(config: TokenizeConfig) -> TokenizeManifest:
    """Plan, execute (resuming), check conservation, write the manifest; returns it."""
    from prep.tokenize.summary import summarize_output

    loaded = read_dataset_config(config.dataset_config, list(config.datasets) or None)
    specs = loaded.specs
    log_skipped(loaded.skipped)  # once, by kind; -v lists each
    processor = _processor_identity(config.processor)  # loadable before anything is written
    chunks = plan_chunks(specs, rows_per_chunk=config.rows_per_chunk, seed=config.seed)
    out = Path(config.output_dir)
    claim_output_dir(
        out,
        run_identity(config, specs, processor),
        (SAMPLES_DIR, ERRORS_DIR),
        f"prep {Stage.TOKENIZE}",
        OutputDirConflict,
    )
    pending = [c for c in chunks if not _done(out, c)]
    log.info("tokenize: %d chunks, %d already done, %d to run", len(chunks), len(chunks) - len(pending), len(pending))
    worker_config = {k: v for k, v in asdict(config).items() if k != "executor"}
    worker_kwargs = {
        "config_json": json.dumps({**worker_config, "output_dir": str(out)}),
        "specs_json": json.dumps([spec_to_json(s) for s in specs]),
    }
    run_tasks(TokenizeWorker, worker_kwargs, [_chunk_json(c) for c in pending], config.executor, desc="tokenize")
    expected = sum(sum(c.copies) for c in chunks)
    summary = summarize_output(out, [c.index for c in chunks], tuple(s.name for s in specs))
    if summary.rows.samples + summary.rows.errors != expected:
        raise ConservationError(
            f"{expected} input rows but {summary.rows.samples} samples + {summary.rows.errors} errors"
        )
    manifest = TokenizeManifest.create(
        config=config.output_fields(),
        datasets=tuple(spec_to_json(s) for s in specs),
        processor=processor,
        inputs=TokenizeInputs(records=sum(len(c.copies) for c in chunks), rows_used=expected, chunks=len(chunks)),
        rows=summary.rows,
        per_dataset=summary.per_dataset,
        errors_by_reason=summary.errors_by_reason,
        tokens=summary.tokens,
        verify=summary.verify,
    )
    crash_point("tokenize.before_manifest")
    write_json_atomic(out / MANIFEST_FILE, manifest.to_json())
    check_error_budget(manifest, config.max_error_rate, out)
    return manifest


def check_error_budget(manifest: TokenizeManifest, max_error_rate: float, out: Path) -> None:
    """Fail when any dataset lost more than ``max_error_rate`` of its rows, or yielded no sample:
    an empty dataset (no row at all) fails whatever the rate, an all-errors one unless the rate is 1.

    Raises:
        ErrorRateExceeded: Names each dataset over budget with its rate, its top error reasons
            with an example row (sample_id + message) each, and the per-dataset table.
    """
    from prep.tokenize.summary import error_examples, format_dataset_table

    over: dict[str, str] = {}
    empty: dict[str, str] = {}
    for name, rows in manifest.per_dataset.items():
        total = rows.samples + rows.errors
        rate = rows.errors / total if total else 0.0
        if not total:
            empty[name] = next((s["file_name"] for s in manifest.datasets if s["name"] == name), "?")
        elif rate > max_error_rate or (not rows.samples and max_error_rate < 1.0):
            over[name] = f"{name} {rows.errors:,}/{total:,} rows ({rate:.1%})"
    if not (over or empty):
        return
    lines = []
    if empty:
        files = "; ".join(f"{name!r} ({file})" for name, file in empty.items())
        lines.append(f"no rows at all (an empty file or an empty list) in dataset {files}: fill it or leave it out")
    if over:
        lines.append(f"error rate over --max-error-rate {max_error_rate:.1%}: {'; '.join(over.values())}")
    for name, examples in error_examples(out, set(over)).items():
        lines.append(f"  dataset {name!r}, top error reasons:")
        lines += [f"    {e.reason} {e.count:,}, e.g. {e.sample_id}: {e.message}" for e in examples]
    lines += ["per dataset:", format_dataset_table(manifest)]
    raise ErrorRateExceeded(
        "\n".join(lines) + f"\nOutputs are kept in {out}: see why with `prep errors {out}`; fix the data or "
        "raise --max-error-rate (rerunning with only that change resumes)"
    )


def _processor_identity(path: str) -> ProcessorIdentity:
    """Load the processor once here, so a wrong ``--processor`` is one message before any output."""
    from families.processor import ProcessorLoadError, load_processor_once
    from families.registry import counter_image_attention
    from families.requirements import check_processor_class, declared_processor_class

    check_processor_class(declared_processor_class(path))  # one line, not an ImportError inside transformers
    try:
        raw = load_processor_once(path).identity()
    except ProcessorLoadError:
        raise
    except (OSError, ValueError) as exc:  # hub ids that do not exist, unreachable hub, broken files
        hint = "" if Path(path).exists() else " (no such local directory, and not a loadable hub id)"
        raise ProcessorLoadError(f"--processor {path!r} does not load{hint}: {str(exc).splitlines()[0]}") from exc
    return ProcessorIdentity(
        class_name=raw["class"],
        sha256=raw["sha256"],
        source=raw["source"],
        image_attention=counter_image_attention(raw["class"]),
    )
