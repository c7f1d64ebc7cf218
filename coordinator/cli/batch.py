"""``specfleet batch``: run a JSONL batch file through the fleet, JSONL results out."""

from __future__ import annotations

import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Annotated

import typer
from redis import RedisError
from rich.progress import Progress

from coordinator.batch import run_batch
from coordinator.cli.app import app, environment_settings, fail
from coordinator.client import Coordinator
from shared.logs import configure_logging


@app.command()
def batch(
    input_path: Annotated[Path, typer.Argument(metavar="INPUT.jsonl",
                                               help='lines {"custom_id", "body": request}')],
    model: Annotated[str, typer.Option(help="model for lines whose body names none")],
    out: Annotated[Path, typer.Option(help="results, one JSON line per request")],
    errors: Annotated[Path | None, typer.Option(help="failed and invalid lines (default: --out)")]
    = None,
    timeout: Annotated[float | None, typer.Option(help="seconds to wait for each result")]
    = None,
) -> None:
    """Submit every line of a batch file and write the results as JSONL."""
    settings = environment_settings()
    configure_logging(settings.log_level, settings.log_format)
    if not input_path.is_file():
        fail(f"input file not found: {input_path}")
    with ExitStack() as stack:
        try:
            lines = stack.enter_context(input_path.open(encoding="utf-8"))
            out_file = stack.enter_context(out.open("w", encoding="utf-8"))
            err_file = stack.enter_context(errors.open("w", encoding="utf-8")) if errors else None
        except OSError as exc:
            fail(f"{exc.filename}: {exc.strerror}")
        progress = None
        if sys.stderr.isatty():
            bar = stack.enter_context(Progress(transient=True))
            task = bar.add_task("batch", total=None)

            def progress(done: int, total: int) -> None:
                bar.update(task, completed=done, total=total)
        try:
            summary = run_batch(Coordinator(settings), lines, out_file, err_file, model=model,
                                timeout=timeout, progress=progress)
        except RedisError as exc:
            fail(f"Redis at {settings.redis_url}: {exc}", code=3)
        except TimeoutError as exc:
            fail(str(exc), code=1)
    sys.stderr.write(f"batch {summary.batch_id}: {summary.total} requests, "
                     f"{summary.completed} completed, {summary.failed} failed, "
                     f"{summary.invalid} invalid\n")
    for message in summary.errors:
        sys.stderr.write(f"  {message}\n")
    if summary.failed or summary.invalid:
        raise typer.Exit(1)
