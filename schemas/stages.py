"""Stage names: one spelling per stage, used for folders, subcommands and manifests."""

from __future__ import annotations

from enum import Enum


class Stage(str, Enum):
    """A packvlm stage; its value is the ``stage`` field of the manifest it writes."""

    TOKENIZE = "tokenize"
    PACK = "pack"
    SHARDS = "shards"
    ENERGON_INDEX = "energon-index"
    STATS = "stats"
    TRAIN = "train"

    def __str__(self) -> str:
        return self.value
