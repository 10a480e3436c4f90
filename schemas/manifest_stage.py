"""Read a manifest when the caller accepts several stages (`prep stats DIR`: tokenize or pack).

The ``stage`` field picks the class, then that class checks version and fields exactly as
`schemas.manifest.read_manifest` does, so trying classes one by one (and telling a stage
mismatch from a malformed file by message) is never needed.
"""

from __future__ import annotations

import json
from pathlib import Path

from schemas.manifest import Manifest, ManifestError


def read_manifest_of(path: str | Path, classes: tuple[type[Manifest], ...]) -> Manifest:
    """Load the manifest at ``path`` as whichever of ``classes`` its stage names.

    Raises:
        ManifestError: Missing or unreadable file, a stage none of ``classes`` reads, or
            (from the chosen class) an unknown version or a malformed field.
    """
    path = Path(path)
    stages = " or ".join(f"`prep {cls.STAGE.value}`" for cls in classes)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ManifestError(f"{path} does not exist: not a finished {stages} output") from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{path} is unreadable ({exc})") from exc
    stage = raw.get("stage") if isinstance(raw, dict) else None
    for cls in classes:
        if stage == cls.STAGE.value:
            return cls.from_json(raw, str(path))
    raise ManifestError(f"{path} was written by `prep {stage}`, expected the output of {stages}")
