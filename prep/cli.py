"""The `prep` command group: one subcommand per stage, each defined in its stage's cli module."""

from __future__ import annotations

import click

from packvlm.cli import ErrorMappingGroup, debug_option
from packvlm.console import configure_logging
from packvlm.secrets import install_log_redaction
from prep.energon.cli import energon_blend_command, energon_index_command
from prep.errors.cli import errors_command
from prep.example.cli import example_command
from prep.pipeline import pack_command
from prep.shards.cli import shards_command
from prep.stats.cli import stats_command
from prep.tokenize.cli import tokenize_command


class PrepGroup(ErrorMappingGroup):
    """Every failure is one line and one exit code (`packvlm.errors`), not a traceback."""

    interrupt_hint = "rerun the same command to resume"


@click.group(cls=PrepGroup)
@click.version_option(package_name="packvlm")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
@debug_option
def main(verbose: bool, debug: bool) -> None:
    """packvlm offline data preparation."""
    configure_logging(verbose)
    install_log_redaction()  # credentials never reach a log line (packvlm.secrets)


main.add_command(example_command)
main.add_command(tokenize_command)
main.add_command(pack_command)
main.add_command(shards_command)
main.add_command(energon_index_command)
main.add_command(energon_blend_command)
main.add_command(stats_command)
main.add_command(errors_command)


if __name__ == "__main__":
    main()
