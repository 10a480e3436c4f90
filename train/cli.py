"""The `train` command group: it only assembles the recipes' commands (`train.recipes`)."""

from __future__ import annotations

import click

from packvlm.cli import ErrorMappingGroup, debug_option
from packvlm.console import configure_logging
from packvlm.secrets import install_log_redaction
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
    configure_logging(verbose)
    install_log_redaction()  # credentials never reach a log line (packvlm.secrets)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's shard bar would cut through the step bar


main.add_command(hf_command)
main.add_command(megatron_command)
main.add_command(export_command)


if __name__ == "__main__":
    main()
