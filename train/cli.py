"""The `train` command group; the packed-batch loops register their commands here."""

from __future__ import annotations

import click


@click.group()
def main() -> None:
    """packvlm training-side tools (packed micro-batches for Megatron and HF loops)."""
