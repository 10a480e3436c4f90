"""`prep energon-index` and `prep energon-blend`: flags -> index/blend functions."""

from __future__ import annotations

import click


@click.command("energon-index")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--split-ratio",
    default=None,
    help="train,val,test share of packs, met at the nearest shard boundaries or refused when far off "
    "(default: the split `prep pack --split-ratio` recorded; every pack in train without one).",
)
@click.option(
    "--split-pattern",
    "split_patterns",
    multiple=True,
    help="SPLIT:REGEX on shard paths (repeatable), passed to Energon as is; not with --split-ratio.",
)
@click.option("--workers", type=click.IntRange(min=1), default=2, show_default=True, help="Processes indexing shards.")
@click.option(
    "--verify",
    is_flag=True,
    help="Check every shard's sha256 against shards.json first, then load the result with Energon and check "
    "every pack comes back once.",
)
def energon_index_command(
    directory: str, split_ratio: str | None, split_patterns: tuple[str, ...], workers: int, verify: bool
) -> None:
    """Make a `prep pack` output DIRECTORY an Energon dataset (Energon's own prepare API)."""
    from prep.energon.index import (
        index_dataset,
        parse_split_patterns,
        parse_split_ratio,
        verify_dataset,
    )
    from prep.energon.split import format_counts
    from schemas.energon import EnergonIndexError

    if split_ratio and split_patterns:
        raise EnergonIndexError("give --split-ratio or --split-pattern, not both")
    result = index_dataset(
        directory,
        split_ratio=parse_split_ratio(split_ratio) if split_ratio else None,
        split_patterns=parse_split_patterns(split_patterns) if split_patterns else None,
        workers=workers,
        verify_hashes=verify,
    )
    counts = result.packs_per_split()
    wanted = f" (wanted {format_counts(result.wanted)})" if result.wanted else ""
    click.echo(
        f"indexed {len(result.shard_counts)} shards, {sum(result.shard_counts.values()):,} packs: "
        + ", ".join(f"{k} {v:,}" for k, v in counts.items())
        + wanted
    )
    if verify:
        loaded = verify_dataset(directory)
        click.echo(
            "verified with Energon: " + ", ".join(f"{k} {v:,}" for k, v in loaded.items()) + " packs, each exactly once"
        )


@click.command("energon-blend")
@click.option("--blend", "blends", multiple=True, required=True, help="PATH=WEIGHT of an indexed dataset (repeatable).")
@click.option("--output", required=True, type=click.Path(dir_okay=False), help="MetadatasetV2 YAML to write.")
@click.option("--split", default="train", show_default=True, help="Split the blend defines.")
def energon_blend_command(blends: tuple[str, ...], output: str, split: str) -> None:
    """Write a MetadatasetV2 YAML blending indexed datasets by weight."""
    from prep.energon.blend import parse_blend, write_blend

    definition = write_blend([parse_blend(b) for b in blends], output, split)
    total = sum(e["weight"] for e in definition["splits"][split]["blend"])
    click.echo(
        f"wrote {output}: "
        + ", ".join(f"{e['path']} {e['weight'] / total:.1%}" for e in definition["splits"][split]["blend"])
    )
