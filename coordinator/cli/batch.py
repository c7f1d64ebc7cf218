"""``specfleet batch``: batches that live in Redis (``submit|status|results|cancel|list``).

Every sub-command is a thin layer over :class:`coordinator.batch.BatchStore`, the same code
the HTTP gateway's ``/v1/batches`` runs. The old form ``specfleet batch FILE --model M --out
OUT`` still works: it is ``submit --wait`` followed by ``results``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path
from typing import IO, Annotated, Any

import typer
from redis import RedisError
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from typer.core import TyperGroup

from coordinator.batch import CREATOR_LEASE_SECONDS, TERMINAL, BatchStore
from coordinator.cli.app import app, environment_settings, fail, fail_redis
from coordinator.client import Coordinator
from coordinator.openai_api.requests import ENDPOINTS, NATIVE
from coordinator.tenancy import StoreError
from shared.logs import configure_logging
from shared.outage import RedisOutage, ride_out
from shared.settings import Settings

#: Seconds between two looks at a batch being waited for.
POLL_SECONDS = 0.25


class _BatchGroup(TyperGroup):
    """``specfleet batch FILE ...`` (no sub-command name) means ``specfleet batch run FILE``."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


batch_app = typer.Typer(cls=_BatchGroup, no_args_is_help=True,
                        help="Batches that live in Redis: submit, status, results, cancel, list.")
app.add_typer(batch_app, name="batch")


@contextmanager
def _store() -> Iterator[tuple[BatchStore, Settings]]:
    """The batch store, with every Redis or batch error as a one-line CLI error."""
    settings = environment_settings()
    configure_logging(settings.log_level, settings.log_format)
    try:
        yield BatchStore(Coordinator(settings)), settings
    except (RedisError, RedisOutage) as exc:
        fail_redis(settings, exc)
    except StoreError as exc:
        fail(str(exc), code=1 if exc.status == 404 else 2)


def _submit(store: BatchStore, path: Path, endpoint: str, model: str | None) -> dict[str, Any]:
    try:
        content = path.read_bytes()
    except OSError as exc:
        fail(f"{exc.filename}: {exc.strerror}")
    uploaded = store.files.upload(content, path.name)
    return store.create(uploaded["id"], endpoint, model=model)


def _advance(store: BatchStore, batch_id: str, outage_seconds: float) -> None:
    """Queue the batch's lines from this process (any gateway's batch pump would too),
    riding out Redis blips; while another process holds the batch, wait for it to finish."""
    while not ride_out(partial(store.advance, batch_id), outage_seconds, "batch.advance"):
        time.sleep(CREATOR_LEASE_SECONDS / 3)


def _wait(store: BatchStore, batch_id: str, timeout: float | None,
          outage_seconds: float) -> dict[str, Any]:
    """Poll the batch until it ends, with a progress bar on a terminal; a Redis that refuses
    for a while (restarting, out of memory ...) is waited out for up to ``outage_seconds``
    (the batch runs on meanwhile)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    started, first_tokens = time.monotonic(), None
    with ExitStack() as stack:
        bar = task = None
        if sys.stderr.isatty():
            bar = stack.enter_context(Progress(
                TextColumn("{task.description}"), BarColumn(),
                TextColumn("{task.fields[done]} done, {task.fields[failed]} failed, "
                           "{task.total} total"),
                TextColumn("{task.fields[tps]:.1f} tok/s"), TimeRemainingColumn(),
                transient=True, console=Console(stderr=True)))
            task = bar.add_task(batch_id, total=None, done=0, failed=0, tps=0.0)
        while True:
            batch = ride_out(lambda: store.get(batch_id), outage_seconds, "batch.status")
            counts = batch["request_counts"]
            tokens = batch["specfleet"]["generated_tokens"]
            first_tokens = tokens if first_tokens is None else first_tokens
            if bar is not None and task is not None:
                elapsed = max(time.monotonic() - started, 1e-6)
                bar.update(task, total=counts["total"],
                           completed=counts["completed"] + counts["failed"],
                           done=counts["completed"], failed=counts["failed"],
                           tps=(tokens - first_tokens) / elapsed)
            if batch["status"] in TERMINAL:
                return batch
            if deadline is not None and time.monotonic() > deadline:
                fail(f"batch {batch_id} did not finish within {timeout} s (it keeps running: "
                     f"specfleet batch results {batch_id})", code=1)
            time.sleep(POLL_SECONDS)


def _write_results(store: BatchStore, batch_id: str, out: IO[str],
                   errors: IO[str] | None) -> None:
    """Output lines to ``out`` and error lines to ``errors`` (or ``out``), in input order."""
    for line in store.result_lines(batch_id, "all"):
        target = out if line["error"] is None or errors is None else errors
        target.write(json.dumps(line) + "\n")


def _summary(batch: dict[str, Any]) -> None:
    counts, invalid = batch["request_counts"], batch["specfleet"]["invalid"]
    sys.stderr.write(f"batch {batch['id']} {batch['status']}: {counts['total']} requests, "
                     f"{counts['completed']} completed, {counts['failed'] - invalid} failed, "
                     f"{invalid} invalid\n")


def _open_outputs(stack: ExitStack, out: Path,
                  errors: Path | None) -> tuple[IO[str], IO[str] | None]:
    try:
        out_file = stack.enter_context(out.open("w", encoding="utf-8"))
        err_file = stack.enter_context(errors.open("w", encoding="utf-8")) if errors else None
    except OSError as exc:
        fail(f"{exc.filename}: {exc.strerror}")
    return out_file, err_file


InputFile = Annotated[Path, typer.Argument(metavar="INPUT.jsonl",
                                           help='lines {"custom_id", "body": request}')]
Endpoint = Annotated[str, typer.Option(help=f"what the lines' bodies are: {', '.join(ENDPOINTS)}")]
BatchId = Annotated[str, typer.Argument(metavar="BATCH_ID")]
Out = Annotated[Path, typer.Option(help="output lines, one JSON line per request")]
Errors = Annotated[Path | None, typer.Option(help="error lines (default: --out)")]
Timeout = Annotated[float | None, typer.Option(help="seconds to wait for the batch")]


@batch_app.command("run", hidden=True)
def run(input_path: InputFile, model: Annotated[str, typer.Option(
            help="model for lines whose body names none")],
        out: Out, errors: Errors = None, timeout: Timeout = None,
        endpoint: Endpoint = NATIVE) -> None:
    """Submit a batch file, wait for it, write its results (``submit --wait`` + ``results``)."""
    if not input_path.is_file():
        fail(f"input file not found: {input_path}")
    with ExitStack() as stack:
        out_file, err_file = _open_outputs(stack, out, errors)
        with _store() as (store, settings):
            batch_id = _submit(store, input_path, endpoint, model)["id"]
            _advance(store, batch_id, settings.redis_outage_seconds)
            batch = _wait(store, batch_id, timeout, settings.redis_outage_seconds)
            _write_results(store, batch["id"], out_file, err_file)
            messages = [line["error"]["message"]
                        for line in store.result_lines(batch["id"], "errors")]
    _summary(batch)
    for message in messages:
        sys.stderr.write(f"  {message}\n")
    if batch["request_counts"]["failed"]:
        raise typer.Exit(1)


@batch_app.command()
def submit(input_path: InputFile, endpoint: Endpoint = NATIVE,
           model: Annotated[str | None, typer.Option(
               help="model for lines whose body names none")] = None,
           wait: Annotated[bool, typer.Option(help="wait until the batch ends")] = False,
           timeout: Timeout = None) -> None:
    """Upload a batch file and queue its lines; print the batch id (--wait: the id first,
    so the batch can be found whatever happens to this command, then the ended batch)."""
    with _store() as (store, settings):
        batch = _submit(store, input_path, endpoint, model)
        print(batch["id"], flush=True)
        _advance(store, batch["id"], settings.redis_outage_seconds)
        if wait:
            batch = _wait(store, batch["id"], timeout, settings.redis_outage_seconds)
            print(json.dumps(batch))
    if wait and batch["status"] != "completed":
        raise typer.Exit(1)


@batch_app.command()
def status(batch_id: BatchId) -> None:
    """Print the batch object (status, request_counts, output/error file ids)."""
    with _store() as (store, _):
        print(json.dumps(store.get(batch_id)))


@batch_app.command()
def results(batch_id: BatchId, out: Out, errors: Errors = None) -> None:
    """Write a batch's output (and error) lines, in input order."""
    with ExitStack() as stack:
        out_file, err_file = _open_outputs(stack, out, errors)
        with _store() as (store, _):
            batch = store.get(batch_id)
            if batch["status"] not in TERMINAL:
                fail(f"batch {batch_id} is {batch['status']}: results are written when it "
                     "ends (specfleet batch submit --wait, or wait and retry)", code=1)
            _write_results(store, batch_id, out_file, err_file)
    _summary(batch)


@batch_app.command()
def cancel(batch_id: BatchId) -> None:
    """Cancel a batch: queued lines are withdrawn, running ones stop at their next step."""
    with _store() as (store, _):
        print(json.dumps(store.cancel(batch_id)))


@batch_app.command("list")
def list_batches(limit: Annotated[int, typer.Option(min=1, max=100)] = 20) -> None:
    """The newest batches, one JSON object a line."""
    with _store() as (store, _):
        for batch in store.list(limit):
            print(json.dumps(batch))
