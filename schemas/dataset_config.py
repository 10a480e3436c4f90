"""The dataset config read by `prep tokenize`: LLaMA-Factory's ``dataset_info.json``, as is.

A JSON object mapping dataset name to an entry. Keys, defaults and their meaning follow
LLaMA-Factory (``src/llamafactory/data/parser.py``, ``DatasetAttr``; ``data/README.md``)::

    {
      "llava": {
        "file_name": "llava.jsonl",            # relative to the config; file or folder
        "formatting": "sharegpt",              # absent: "alpaca", as in LLaMA-Factory
        "columns": {"messages": "conversations", "images": "images", "tools": "tools"},
        "tags": {"role_tag": "from", "content_tag": "value", "user_tag": "human",
                 "assistant_tag": "gpt", "function_tag": "function_call",
                 "observation_tag": "observation", "system_tag": "system"},
        "num_samples": 1000, "split": "train",  # LLaMA-Factory keys
        "media_dir": "media",                  # packvlm: relative media paths resolve here
        "media_root": ["media"],               # packvlm: media must resolve inside (str or list)
        "sample_ratio": 1.0,                   # packvlm: <1 seeded subset, >1 copies + seeded rest
        "video": {"fps": 2.0, "min_frames": 4, "max_frames": 768}
      }
    }

Defaults: without ``columns``, alpaca reads ``instruction``/``input``/``output`` and ShareGPT
``conversations``; with ``columns``, an alpaca ``prompt``/``query``/``response`` not listed is
not read (``DatasetAttr.join`` sets it to None), which is how LLaMA-Factory marks pre-training
entries. ``history``, ``system``, ``tools``, ``images`` and ``videos`` are read under their
own names unless renamed (LLaMA-Factory reads them only when listed; a row without them is
unaffected). Tags not listed keep LLaMA-Factory's documented defaults.

Entries that are not supervised fine-tuning data or are not on local disk (``ranking``, a
``kto_tag`` column, an ``audios`` column, a hub or script entry without ``file_name``, an
alpaca entry without a response column) raise :class:`UnsupportedEntry`: selected by name
they stop the run; otherwise they are skipped and listed (:func:`read_dataset_config`).
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from packvlm.errors import UsageError

DATASET_CONFIG_VERSION = 1
_CREDENTIALS_IN_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/?#@\s]+@")  # user[:password]@ (packvlm.secrets)
HUB_KEYS = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url")
ENTRY_KEYS = frozenset(
    {"file_name", "cloud_file_name", "formatting", "ranking", "subset", "split", "folder", "num_samples"}
    | {"columns", "tags", "media_dir", "media_root", "sample_ratio", "video", *HUB_KEYS}
)
ALPACA_TEXT_COLUMNS = ("prompt", "query", "response")  # unset when `columns` is given without them
UNUSED_COLUMNS = frozenset({"chosen", "rejected"})  # read by LLaMA-Factory only with ranking: true
SELECT_OTHERS = "select other entries with --dataset"

log = logging.getLogger(__name__)


class ConfigError(UsageError, ValueError):
    """The dataset config is unusable; the message says which key to fix."""


class UnsupportedEntry(ConfigError):
    """A valid LLaMA-Factory entry that `prep tokenize` cannot read (not SFT, or not local).

    ``kind`` says why in a few words (one of `SKIP_KINDS`), so a whole ``dataset_info.json``'s
    skipped entries can be summarised by kind.
    """

    def __init__(self, message: str, kind: str = "not supervised") -> None:
        super().__init__(message)
        self.kind = kind


SKIP_KINDS = ("not on local disk", "preference (DPO/RM/KTO)", "audio", "pre-training text")


@dataclass(frozen=True, kw_only=True, slots=True)
class Columns:
    """Column names of a record (LLaMA-Factory ``columns``); None: not read."""

    prompt: str | None = "instruction"  # alpaca
    query: str | None = "input"  # alpaca
    response: str | None = "output"  # alpaca
    history: str | None = "history"  # alpaca: [[prompt, response], ...] before the prompt
    messages: str = "conversations"  # sharegpt
    system: str | None = "system"
    tools: str | None = "tools"
    images: str | None = "images"
    videos: str | None = "videos"


@dataclass(frozen=True, kw_only=True, slots=True)
class Tags:
    """ShareGPT turn keys and role names (LLaMA-Factory ``tags``).

    Records spelled ``role``/``content`` with ``user``/``assistant``/``system``/``tool`` roles
    are read as well, whatever the tags say.
    """

    role_tag: str = "from"
    content_tag: str = "value"
    user_tag: str = "human"
    assistant_tag: str = "gpt"
    observation_tag: str = "observation"
    function_tag: str = "function_call"
    system_tag: str = "system"


@dataclass(frozen=True, kw_only=True, slots=True)
class VideoSampling:
    """Frame-sampling request passed to the processor; ``fps=None`` keeps every frame."""

    fps: float | None = 2.0
    min_frames: int | None = None
    max_frames: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class DatasetSpec:
    name: str
    file_name: Path  # absolute after loading; for a cloud entry Path(cloud_file_name), unused
    media_dir: Path  # absolute after loading
    formatting: str = "alpaca"
    columns: Columns = field(default_factory=Columns)
    tags: Tags = field(default_factory=Tags)
    sample_ratio: float = 1.0
    video: VideoSampling = field(default_factory=VideoSampling)
    num_samples: int | None = None  # LLaMA-Factory: a seeded subset of this many records
    split: str = "train"  # LLaMA-Factory: the split of a dataset folder
    cloud_file_name: str | None = None  # s3:// or gs:// URL; replaces file_name when set
    media_roots: tuple[Path, ...] = ()  # "media_root": media resolving elsewhere are media_outside_root rows


@dataclass(frozen=True, kw_only=True, slots=True)
class SkippedEntry:
    name: str
    why: str  # the whole message: entry, key and what to do
    kind: str = "not supervised"  # UnsupportedEntry.kind


@dataclass(frozen=True, kw_only=True, slots=True)
class DatasetConfig:
    """What a config file yields: the readable entries, and those skipped (only without ``--dataset``)."""

    specs: list[DatasetSpec]
    skipped: list[SkippedEntry]


def _sub(cls: type, raw: Any, where: str, extra: frozenset[str] = frozenset()) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be an object, got {type(raw).__name__}")
    known = {f.name for f in fields(cls)} | extra
    unknown = set(raw) - known
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}; allowed {sorted(known)}")
    return dict(raw)


def _columns(raw: dict[str, Any], where: str, formatting: str) -> Columns:
    """LLaMA-Factory's column rules (``DatasetAttr.join``); refuses non-SFT columns."""
    given = _sub(Columns, raw.get("columns"), f"{where}.columns", UNUSED_COLUMNS | {"audios", "kto_tag"})
    if given.get("kto_tag"):
        raise UnsupportedEntry(
            f"{where}: columns.kto_tag makes it a KTO (preference) dataset; prep tokenize makes supervised "
            f"samples: remove kto_tag to train on its conversations as SFT, or {SELECT_OTHERS}",
            SKIP_KINDS[1],
        )
    if given.get("audios"):
        raise UnsupportedEntry(
            f"{where}: columns.audios: audio inputs are not supported (no audio token counts); "
            f"drop the audios column, or {SELECT_OTHERS}",
            SKIP_KINDS[2],
        )
    kwargs = {k: v for k, v in given.items() if k not in UNUSED_COLUMNS | {"audios", "kto_tag"}}
    if "columns" in raw:
        kwargs.update({k: given.get(k) for k in ALPACA_TEXT_COLUMNS})
    for key, value in kwargs.items():
        if value is not None and not (isinstance(value, str) and value):
            raise ConfigError(f"{where}.columns.{key} must be a column name (a non-empty string) or null")
    if kwargs.get("messages", "x") is None:
        raise ConfigError(f"{where}.columns.messages must name the column of the turns")
    columns = Columns(**kwargs)
    if formatting == "alpaca" and columns.response is None:
        raise UnsupportedEntry(
            f"{where}: an alpaca entry without columns.response is pre-training text (LLaMA-Factory's stage pt); "
            f"prep tokenize makes supervised samples: add columns.response, or {SELECT_OTHERS}",
            SKIP_KINDS[3],
        )
    return columns


def _refuse_non_sft(name: str, raw: dict[str, Any], where: str) -> None:
    if raw.get("ranking"):
        raise UnsupportedEntry(
            f"{where}: ranking: true is a preference (DPO/RM) dataset; prep tokenize makes supervised samples; "
            f"{SELECT_OTHERS}",
            SKIP_KINDS[1],
        )
    if "file_name" not in raw and "cloud_file_name" not in raw:
        hub = [k for k in HUB_KEYS if k in raw]
        if hub:
            raise UnsupportedEntry(
                f"{where}: {hub[0]} {raw[hub[0]]!r} is not on local disk; download it and point file_name at it "
                f"(a file or folder, relative to the config), or {SELECT_OTHERS}",
                SKIP_KINDS[0],
            )
        raise ConfigError(f"{where}: missing 'file_name' (or 'cloud_file_name')")


def parse_dataset_spec(name: str, raw: dict[str, Any], base_dir: Path) -> DatasetSpec:
    """Validate one dataset entry; relative paths resolve against ``base_dir``.

    Raises:
        UnsupportedEntry: A LLaMA-Factory entry that is not local SFT data.
        ConfigError: A mistake in the entry (unknown key, missing file, bad value).
    """
    where = f"dataset {name!r}"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be an object")
    unknown = set(raw) - ENTRY_KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}; allowed {sorted(ENTRY_KEYS)}")
    _refuse_non_sft(name, raw, where)
    formatting = raw.get("formatting", "alpaca")
    if formatting not in ("alpaca", "sharegpt"):
        raise ConfigError(
            f"{where}: formatting {formatting!r} unsupported; use 'alpaca' (the default) or 'sharegpt' "
            "(OpenAI-style records: sharegpt with columns.messages 'messages' and role/content tags)"
        )
    ratio = float(raw.get("sample_ratio", 1.0))
    if not ratio > 0:
        raise ConfigError(f"{where}: sample_ratio must be > 0, got {ratio}")
    num_samples = raw.get("num_samples")
    if num_samples is not None and (isinstance(num_samples, bool) or not isinstance(num_samples, int)):
        raise ConfigError(f"{where}: num_samples must be an integer, got {num_samples!r}")
    if num_samples is not None and num_samples < 1:
        raise ConfigError(f"{where}: num_samples must be >= 1, got {num_samples}")
    split = raw.get("split", "train")
    if not isinstance(split, str) or not split:
        raise ConfigError(f"{where}: split must be a split name such as 'train', got {split!r}")
    cloud = raw.get("cloud_file_name")
    if cloud is not None and not (isinstance(cloud, str) and "://" in cloud):
        raise ConfigError(f"{where}: cloud_file_name must be a URL such as 's3://bucket/data.jsonl', got {cloud!r}")
    if cloud is not None and _CREDENTIALS_IN_URL.match(cloud):
        raise ConfigError(
            f"{where}: cloud_file_name carries credentials (user:secret@), which would be recorded as the data's "
            "address in manifests and errors: give them in the environment (AWS_ACCESS_KEY_ID, "
            "AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN) or the SDK's credential files instead"
        )
    if cloud is not None:
        file_name = Path(cloud)
    else:
        file_name = _resolve(base_dir / raw["file_name"], f"{where}: file_name")
        if not file_name.exists():
            raise ConfigError(f"{where}: file_name {str(file_name)!r} does not exist")
    media_dir = _resolve(base_dir / raw.get("media_dir", "."), f"{where}: media_dir")
    if not media_dir.is_dir():
        raise ConfigError(f"{where}: media_dir {str(media_dir)!r} is not a directory")
    media_roots = _media_roots(raw.get("media_root"), base_dir, where)
    video = VideoSampling(**_sub(VideoSampling, raw.get("video"), f"{where}.video"))
    if video.fps is not None and video.fps <= 0:
        raise ConfigError(f"{where}.video.fps must be > 0 or null")
    return DatasetSpec(
        name=name,
        file_name=file_name,
        media_dir=media_dir,
        formatting=formatting,
        columns=_columns(raw, where, formatting),
        tags=Tags(**_sub(Tags, raw.get("tags"), f"{where}.tags")),
        sample_ratio=ratio,
        video=video,
        num_samples=num_samples,
        split=split,
        cloud_file_name=cloud,
        media_roots=media_roots,
    )


def _media_roots(raw: Any, base_dir: Path, where: str) -> tuple[Path, ...]:
    """``media_root``: a directory or a list of them, relative to the config, resolved through symlinks."""
    if raw is None:
        return ()
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list) or not items or not all(isinstance(i, str) and i for i in items):
        raise ConfigError(f"{where}: media_root must be a directory or a list of them, got {raw!r}")
    roots = tuple(_resolve(base_dir / item, f"{where}: media_root") for item in items)
    for root in roots:
        if not root.is_dir():
            raise ConfigError(f"{where}: media_root {str(root)!r} is not a directory")
    return roots


def _resolve(path: Path, what: str) -> Path:
    """``path`` made absolute through its symlinks; a loop is named as such, not "does not exist"."""
    try:
        return path.resolve()
    except (RuntimeError, OSError) as exc:  # Python < 3.13 raises RuntimeError on a loop
        raise ConfigError(f"{what} {str(path)!r} is a symlink loop ({exc})") from exc


def read_dataset_config(path: str | Path, only: list[str] | None = None) -> DatasetConfig:
    """Read and validate a dataset config file; ``only`` selects datasets by name.

    Without ``only``, entries raising :class:`UnsupportedEntry` are skipped and returned in
    ``skipped`` (a whole LLaMA-Factory ``dataset_info.json`` yields its local SFT entries);
    named in ``only``, they raise.
    """
    path = Path(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ConfigError(f"dataset config {str(path)!r} does not exist") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"dataset config {str(path)!r} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"dataset config {str(path)!r} must be a non-empty JSON object")
    names = only or sorted(raw)
    missing = [n for n in names if n not in raw]
    if missing:
        raise ConfigError(f"datasets {missing} not in {str(path)!r}; it has {sorted(raw)}")
    for n in names:
        if ":" in n or "/" in n:
            raise ConfigError(f"dataset name {n!r} may not contain ':' or '/'")
    specs, skipped = [], []
    for n in names:
        try:
            specs.append(parse_dataset_spec(n, raw[n], path.parent.resolve()))
        except UnsupportedEntry as exc:
            if only:
                raise
            skipped.append(SkippedEntry(name=n, why=str(exc), kind=exc.kind))
    if not specs:
        raise ConfigError(
            f"no entry of {str(path)!r} can be read by prep tokenize: " + "; ".join(s.why for s in skipped)
        )
    return DatasetConfig(specs=specs, skipped=skipped)


def load_dataset_config(path: str | Path, only: list[str] | None = None) -> list[DatasetSpec]:
    """The readable entries of a config (see :func:`read_dataset_config`); skipped ones are logged."""
    config = read_dataset_config(path, only)
    log_skipped(config.skipped)
    return config.specs


def log_skipped(skipped: list[SkippedEntry]) -> None:
    """One warning line counting the skipped entries by kind; each entry's message at debug level
    (``prep -v``): a whole LLaMA-Factory ``dataset_info.json`` skips ~100 entries."""
    if not skipped:
        return
    for entry in skipped:
        log.debug("skipped: %s", entry.why)
    kinds = Counter(entry.kind for entry in skipped)
    counts = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0])))
    log.warning(
        "skipped %d %s that prep tokenize cannot read: %s (-v lists each with what to do)",
        len(skipped),
        "entry" if len(skipped) == 1 else "entries",
        counts,
    )


def spec_to_json(spec: DatasetSpec) -> dict[str, Any]:
    """JSON-safe form of a spec for the manifest."""
    out: dict[str, Any] = {}
    for f in fields(spec):
        v = getattr(spec, f.name)
        if isinstance(v, Path):
            v = str(v)
        elif isinstance(v, tuple) and all(isinstance(x, Path) for x in v):
            v = [str(x) for x in v]
        elif hasattr(v, "__dataclass_fields__"):
            v = {g.name: getattr(v, g.name) for g in fields(v)}
        out[f.name] = v
    return out
