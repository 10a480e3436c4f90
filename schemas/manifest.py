"""The JSON manifests stages write beside their output, as typed, versioned dataclasses.

A manifest is the stage's receipt: what ran (stage, options), on what (inputs and their
hashes, processor identity), with which libraries, and what came out (counts, totals). It
holds no timestamps, so the same input and options give a byte-identical file. Consumers
read another stage's output only through these classes (`read_manifest`), never by string
keys; an unknown ``schema_version`` or another stage's manifest is a named error.

Files: ``manifest.json`` of `prep tokenize` (`TokenizeManifest`) and `prep pack`
(`PackManifest`); ``shards.json`` of `prep shards` (`ShardsManifest`), beside the pack
manifest in the packed directory.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from packvlm.errors import UsageError
from schemas.codec import ManifestFormatError, from_json, to_json
from schemas.stages import Stage

TRACKED_LIBRARIES = ("packvlm", "transformers", "tokenizers", "pyarrow", "ray", "numpy", "pillow", "av")
SHARDS_MANIFEST_FILE = "shards.json"


class ManifestError(UsageError, ValueError):
    """A manifest is missing, unreadable, of another stage or malformed; the message says which."""


class ManifestVersionError(ManifestError):
    """A manifest's ``schema_version`` is one this code does not read."""


def library_versions(names: tuple[str, ...] = TRACKED_LIBRARIES) -> dict[str, str]:
    """Installed versions of the libraries whose behaviour shapes a stage's output."""
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def file_sha256(path: str | Path, chunk_bytes: int = 1 << 20) -> str:
    """Hex SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk_bytes):
            digest.update(block)
    return digest.hexdigest()


M = TypeVar("M", bound="Manifest")


@dataclass(frozen=True, kw_only=True, slots=True)
class Manifest:
    """Fields every manifest shares; subclasses set ``STAGE`` and ``VERSION``."""

    STAGE: ClassVar[Stage]
    VERSION: ClassVar[int]

    schema_version: int
    stage: Stage
    libraries: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dict(to_json(self))

    @classmethod
    def from_json(cls: type[M], raw: Any, where: str = "") -> M:
        """Check stage and version first (their errors say what to do), then every field."""
        where = where or cls.__name__
        if not isinstance(raw, dict):
            raise ManifestError(f"{where}: not a JSON object")
        if raw.get("stage") != cls.STAGE.value:
            raise ManifestError(
                f"{where} was written by `prep {raw.get('stage')}`, expected the output of `prep {cls.STAGE.value}`"
            )
        if raw.get("schema_version") != cls.VERSION:
            raise ManifestVersionError(
                f"{where}: {cls.STAGE.value} manifest version {raw.get('schema_version')!r}, this packvlm reads "
                f"version {cls.VERSION}; rerun `prep {cls.STAGE.value}` with this packvlm"
            )
        try:
            return from_json(cls, raw, where)
        except ManifestFormatError as exc:
            raise ManifestError(f"malformed manifest: {exc}") from exc

    @classmethod
    def create(cls: type[M], **fields: Any) -> M:
        """A new manifest of this stage and version, with the installed library versions."""
        return cls(schema_version=cls.VERSION, stage=cls.STAGE, libraries=library_versions(), **fields)


def _load(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ManifestError(f"{path} does not exist: not a finished {what} output") from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{path} is unreadable ({exc}); rerun {what}") from exc


def read_manifest(path: str | Path, cls: type[M]) -> M:
    """Load and check the manifest at ``path`` as ``cls``."""
    path = Path(path)
    return cls.from_json(_load(path, f"`prep {cls.STAGE.value}`"), str(path))


def read_any_manifest(path: str | Path, classes: tuple[type[Manifest], ...]) -> Manifest:
    """Load the manifest at ``path`` as whichever of ``classes`` its ``stage`` names (`prep stats DIR`).

    Raises:
        ManifestError: Missing or unreadable file, a stage none of ``classes`` reads, or
            (from the chosen class) an unknown version or a malformed field.
    """
    path = Path(path)
    stages = " or ".join(f"`prep {cls.STAGE.value}`" for cls in classes)
    raw = _load(path, stages)
    stage = raw.get("stage") if isinstance(raw, dict) else None
    for cls in classes:
        if stage == cls.STAGE.value:
            return cls.from_json(raw, str(path))
    raise ManifestError(f"{path} was written by `prep {stage}`, expected the output of {stages}")


# --- prep tokenize ---------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class ProcessorIdentity:
    """Which processor produced the token ids: class, sha256 over its files, as given."""

    class_name: str = field(metadata={"json": "class"})
    sha256: str
    source: str
    # "bidirectional": the model attends both ways inside an image block (Gemma 3), which a
    # causal packed kernel cannot express; `train` refuses such data rather than mask it wrong.
    image_attention: str = "causal"


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenizeInputs:
    records: int  # records read from the dataset files
    rows_used: int  # records x copies (sample_ratio)
    chunks: int  # = number of parts in samples/ and in errors/


@dataclass(frozen=True, kw_only=True, slots=True)
class RowCounts:
    samples: int
    errors: int


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenTotals:
    total: int
    text: int
    media: int
    max_sample: int
    mean_sample: float


@dataclass(frozen=True, kw_only=True, slots=True)
class VerifyCounts:
    checked: int
    skipped_no_reference: int


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenizeManifest(Manifest):
    """``manifest.json`` of a `prep tokenize` output."""

    STAGE: ClassVar[Stage] = Stage.TOKENIZE
    VERSION: ClassVar[int] = 1

    config: dict[str, Any]  # the options the output depends on
    datasets: tuple[dict[str, Any], ...]  # schemas.dataset_config specs, JSON form
    processor: ProcessorIdentity
    inputs: TokenizeInputs
    rows: RowCounts
    per_dataset: dict[str, RowCounts]
    errors_by_reason: dict[str, int]
    tokens: TokenTotals
    verify: VerifyCounts


# --- prep pack ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class PackInput:
    """One tokenized directory a pack run read, pinned by its manifest's sha256."""

    path: str
    manifest_sha256: str
    processor: ProcessorIdentity
    samples: int


@dataclass(frozen=True, kw_only=True, slots=True)
class PackSampleCounts:
    total: int  # tokenized samples over all inputs
    packed: int
    oversize: int  # total = packed + oversize


@dataclass(frozen=True, kw_only=True, slots=True)
class PackStatistics:
    """How well the plan packs: counts, lower bounds, efficiency and histograms."""

    packs: int
    lb1: int  # ceil(slot tokens / pack_size)
    lb2: int  # Martello-Toth L2 lower bound on the number of packs
    packs_over_lb2: int
    efficiency: float  # real tokens / (packs x pack_size)
    tokens: int  # real tokens in packs
    pad_tokens: int  # slot rounding (pad_to_multiple_of)
    empty_tokens: int  # packs x pack_size - tokens
    fill_histogram: dict[str, int]  # "0.9-1.0" -> packs
    samples_per_pack: dict[str, int]
    media_per_pack: dict[str, int]


@dataclass(frozen=True, kw_only=True, slots=True)
class OversizeSample:
    """A sample whose slot exceeds the pack size: reported, never silently lost."""

    input: int  # index into PackManifest.inputs
    sample_id: str
    num_tokens: int


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanFile:
    """The plan a pack run wrote (``plan.arrow``), pinned for the shards stage."""

    name: str
    sha256: str
    num_packs: int
    num_shards: int


@dataclass(frozen=True, kw_only=True, slots=True)
class PackSplit:
    """One split of the plan: packs [first_pack, first_pack + packs) in shards [first_shard, first_shard + shards)."""

    name: str  # "train" | "val" | "test" (schemas.splits.SPLIT_NAMES)
    ratio: float  # as requested (--split-ratio, not normalised); 1, 0, 0 when none was given
    packs: int
    samples: int
    first_pack: int
    first_shard: int
    shards: int


@dataclass(frozen=True, kw_only=True, slots=True)
class PackManifest(Manifest):
    """``manifest.json`` of a `prep pack` output.

    Version 2: shards are in ``shards.json``. Version 3 adds ``splits`` (train, val, test in
    plan order); a version-2 manifest is read as everything in train. Version 4 drops
    ``packs.pack_size``: ``pack_size`` is the one typed copy, and ``config.pack_size`` (the
    options as given) is checked equal to it when read.
    """

    STAGE: ClassVar[Stage] = Stage.PACK
    VERSION: ClassVar[int] = 4

    config: dict[str, Any]  # the options the output depends on
    pack_size: int
    pad_to_multiple_of: int
    inputs: tuple[PackInput, ...]
    samples: PackSampleCounts
    packs: PackStatistics
    oversize: tuple[OversizeSample, ...]
    plan: PlanFile
    splits: tuple[PackSplit, ...]  # train, val, test, in this order; empty splits included

    @classmethod
    def from_json(cls, raw: Any, where: str = "") -> PackManifest:
        """Read versions 4, 3 (``packs.pack_size`` checked, then dropped) and 2 (also no splits: every pack
        in train).

        Raises:
            ManifestError: ``config.pack_size`` (or a version 3's ``packs.pack_size``) differs from ``pack_size``.
        """
        where = where or cls.__name__
        copies: dict[str, Any] = {}
        if isinstance(raw, dict) and raw.get("stage") == cls.STAGE.value and raw.get("schema_version") in (2, 3):
            if raw["schema_version"] == 2:
                raw = {**raw, "splits": _all_train_splits(raw)}
            if isinstance(raw.get("packs"), dict) and "pack_size" in raw["packs"]:
                copies["packs.pack_size"] = raw["packs"]["pack_size"]
                raw = {**raw, "packs": {k: v for k, v in raw["packs"].items() if k != "pack_size"}}
            raw = {**raw, "schema_version": cls.VERSION}
        manifest = super(PackManifest, cls).from_json(raw, where)
        if "pack_size" in manifest.config:
            copies["config.pack_size"] = manifest.config["pack_size"]
        for name, value in copies.items():
            if value != manifest.pack_size:
                raise ManifestError(
                    f"{where}: {name} {value!r} differs from pack_size {manifest.pack_size}: the manifest was "
                    "edited; rerun `prep pack` into a new directory"
                )
        return manifest


def _all_train_splits(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``splits`` of a version-2 pack manifest: every pack and shard in train."""
    plan = raw["plan"] if isinstance(raw.get("plan"), dict) else {}
    samples = raw["samples"] if isinstance(raw.get("samples"), dict) else {}
    packs, shards = plan.get("num_packs", 0), plan.get("num_shards", 0)
    train = {"ratio": 1.0, "packs": packs, "samples": samples.get("packed", 0), "first_pack": 0, "first_shard": 0}
    empty = {"ratio": 0.0, "packs": 0, "samples": 0, "first_pack": packs, "first_shard": shards, "shards": 0}
    return [{"name": "train", **train, "shards": shards}, {"name": "val", **empty}, {"name": "test", **empty}]


# --- prep shards -------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardRecord:
    name: str  # relative to the packed directory, e.g. "shards/shard-000000.tar"
    packs: int
    samples: int
    bytes: int  # the file's size: checked whenever the shards are opened (a stat)
    sha256: str = ""  # hex SHA-256 of the file, v2 ("" read from version 1: not recorded)


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardsManifest(Manifest):
    """``shards.json``: the shards written from a plan, after reading every one back.

    Version 2 adds each shard's ``sha256`` (`schemas.packed.check_shard_files`); a version-1
    manifest is read with the hashes empty (sizes are still checked; `prep shards` records them).
    """

    STAGE: ClassVar[Stage] = Stage.SHARDS
    VERSION: ClassVar[int] = 2

    plan_sha256: str  # the plan.arrow these shards were written from
    shards: tuple[ShardRecord, ...]

    @classmethod
    def from_json(cls, raw: Any, where: str = "") -> ShardsManifest:
        """Read versions 2 and 1 (no sha256 per shard)."""
        if isinstance(raw, dict) and raw.get("stage") == cls.STAGE.value and raw.get("schema_version") == 1:
            raw = {**raw, "schema_version": cls.VERSION}
        return super(ShardsManifest, cls).from_json(raw, where)

    @property
    def has_sha256(self) -> bool:
        """Whether every shard's hash was recorded (version 2)."""
        return all(s.sha256 for s in self.shards)

    @property
    def num_packs(self) -> int:
        return sum(s.packs for s in self.shards)

    @property
    def num_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)
