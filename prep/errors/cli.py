"""`prep errors`: flags -> ErrorsConfig -> read_errors -> text or JSON on stdout."""

from __future__ import annotations

import json

import click

from prep.errors.core import ErrorsReport, format_errors, format_oversize
from prep.errors.stage import DEFAULT_LIMIT, ErrorsConfig, read_errors
from schemas.codec import to_json
from schemas.reasons import Reason


@click.command("errors")
@click.argument("input_dir", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--reason",
    "reasons",
    multiple=True,
    type=click.Choice([r.value for r in Reason]),
    help="Only this reason (repeatable).",
)
@click.option("--dataset", "datasets", multiple=True, help="Only this dataset (repeatable).")
@click.option(
    "--limit",
    type=click.IntRange(min=0),
    default=DEFAULT_LIMIT,
    show_default=True,
    help="Examples per reason (oversize samples for a pack output); 0 prints counts only.",
)
@click.option("--json", "as_json", is_flag=True, help="Print counts and examples as JSON (messages not shortened).")
def errors_command(
    input_dir: str, reasons: tuple[str, ...], datasets: tuple[str, ...], limit: int, as_json: bool
) -> None:
    """Why rows were lost: a tokenize output's error rows by reason, or a pack output's oversize samples."""
    config = ErrorsConfig(
        input_dir=input_dir,
        reasons=tuple(Reason(r) for r in dict.fromkeys(reasons)),
        datasets=tuple(dict.fromkeys(datasets)),
        limit=limit,
    )
    report = read_errors(config)  # ErrorsQueryError exits 2 (`packvlm.cli`)
    if as_json:
        click.echo(json.dumps(to_json(report), indent=2, ensure_ascii=False))
    elif isinstance(report, ErrorsReport):
        click.echo(format_errors(report))
    else:
        click.echo(format_oversize(report))
