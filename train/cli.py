"""The `train` command group: it only assembles the recipes' commands (`train.recipes`)."""

from __future__ import annotations

import logging

import click

from packvlm.secrets import install_log_redaction
from prep.cli_errors import ErrorMappingGroup, debug_option
from train.export import export_command
from train.recipes.hf import hf_command
from train.recipes.megatron import megatron_command


class TrainGroup(ErrorMappingGroup):
    """Every failure is one line and one exit code (`packvlm.errors`), not a traceback."""


@click.group(cls=TrainGroup)
@click.version_option(package_name="packvlm")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
@debug_option
def main(verbose: bool, debug: bool) -> None:
    """packvlm training on `prep pack` shards: exact packed (THD / varlen) micro-batches."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    install_log_redaction()  # credentials never reach a log line (packvlm.secrets)


main.add_command(hf_command)
main.add_command(megatron_command)
main.add_command(export_command)


if __name__ == "__main__":
    main()
