"""The dataset config read by `prep tokenize` (LLaMA-Factory ``dataset_info.json`` style).

A JSON object mapping dataset name to a spec::

    {
      "llava": {
        "file_name": "llava.jsonl",            # JSON array or JSONL, relative to the config
        "formatting": "sharegpt",
        "columns": {"messages": "conversations", "images": "images",
                    "videos": "videos", "system": "system"},
        "tags": {"role_tag": "from", "content_tag": "value", "user_tag": "human",
                 "assistant_tag": "gpt", "system_tag": "system"},
        "media_dir": "media",                  # relative media paths resolve here
        "sample_ratio": 1.0,                   # <1 seeded subset, >1 copies + seeded rest
        "video": {"fps": 2.0, "min_frames": 4, "max_frames": 768}
      }
    }

Omitted ``columns``/``tags`` default to the ``role``/``content`` OpenAI spelling; records
written with ``from``/``value`` are accepted as well (see :class:`Tags`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

DATASET_CONFIG_VERSION = 1


class ConfigError(ValueError):
    """The dataset config is unusable; the message says which key to fix."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Columns:
    messages: str = "messages"
    images: str = "images"
    videos: str = "videos"
    system: str = "system"


@dataclass(frozen=True, kw_only=True, slots=True)
class Tags:
    role_tag: str = "role"
    content_tag: str = "content"
    user_tag: str = "user"
    assistant_tag: str = "assistant"
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
    file_name: Path  # absolute after loading
    media_dir: Path  # absolute after loading
    formatting: str = "sharegpt"
    columns: Columns = field(default_factory=Columns)
    tags: Tags = field(default_factory=Tags)
    sample_ratio: float = 1.0
    video: VideoSampling = field(default_factory=VideoSampling)


def _sub(cls: type, raw: Any, where: str) -> Any:
    if raw is None:
        return cls()
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be an object, got {type(raw).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = set(raw) - known
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}; allowed {sorted(known)}")
    return cls(**raw)


def parse_dataset_spec(name: str, raw: dict[str, Any], base_dir: Path) -> DatasetSpec:
    """Validate one dataset entry; relative paths resolve against ``base_dir``."""
    where = f"dataset {name!r}"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be an object")
    if "file_name" not in raw:
        raise ConfigError(f"{where}: missing 'file_name'")
    formatting = raw.get("formatting", "sharegpt")
    if formatting != "sharegpt":
        raise ConfigError(f"{where}: formatting {formatting!r} unsupported; use 'sharegpt'")
    allowed = {"file_name", "formatting", "columns", "tags", "media_dir", "sample_ratio", "video"}
    unknown = set(raw) - allowed
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}; allowed {sorted(allowed)}")
    ratio = float(raw.get("sample_ratio", 1.0))
    if not ratio > 0:
        raise ConfigError(f"{where}: sample_ratio must be > 0, got {ratio}")
    file_name = (base_dir / raw["file_name"]).resolve()
    if not file_name.is_file():
        raise ConfigError(f"{where}: file_name {str(file_name)!r} does not exist")
    media_dir = (base_dir / raw.get("media_dir", ".")).resolve()
    if not media_dir.is_dir():
        raise ConfigError(f"{where}: media_dir {str(media_dir)!r} is not a directory")
    video = _sub(VideoSampling, raw.get("video"), f"{where}.video")
    if video.fps is not None and video.fps <= 0:
        raise ConfigError(f"{where}.video.fps must be > 0 or null")
    return DatasetSpec(
        name=name,
        file_name=file_name,
        media_dir=media_dir,
        formatting=formatting,
        columns=_sub(Columns, raw.get("columns"), f"{where}.columns"),
        tags=_sub(Tags, raw.get("tags"), f"{where}.tags"),
        sample_ratio=ratio,
        video=video,
    )


def load_dataset_config(path: str | Path, only: list[str] | None = None) -> list[DatasetSpec]:
    """Read and validate a dataset config file; ``only`` selects datasets by name."""
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
    return [parse_dataset_spec(n, raw[n], path.parent.resolve()) for n in names]


def spec_to_json(spec: DatasetSpec) -> dict[str, Any]:
    """JSON-safe form of a spec for the manifest."""
    out: dict[str, Any] = {}
    for f in fields(spec):
        v = getattr(spec, f.name)
        if isinstance(v, Path):
            v = str(v)
        elif hasattr(v, "__dataclass_fields__"):
            v = {g.name: getattr(v, g.name) for g in fields(v)}
        out[f.name] = v
    return out
