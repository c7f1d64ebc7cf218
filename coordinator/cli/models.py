"""``specfleet models``: the declared models (``add|list|remove``), what clients may name
before any worker of them runs.

A thin layer over :class:`shared.catalog.ModelCatalog` and
:class:`coordinator.models.ModelDirectory`, the same code the gateway's
``/v1/specfleet/models`` and ``/v1/models`` run. ``list`` shows every model declared, served
or loading with its live and loading workers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any, Literal

import typer
from pydantic import ValidationError
from redis import RedisError
from rich.console import Console
from rich.table import Table

from coordinator.cli.app import app, environment_settings, fail, fail_redis
from coordinator.cli.options import AsJson
from coordinator.client import Coordinator
from coordinator.models import ModelListing
from shared.catalog import CatalogError, ModelEntry
from shared.logs import configure_logging
from shared.protocol import describe_validation_error
from shared.redact import redact

models_app = typer.Typer(no_args_is_help=True,
                         help="Declared models: known (and waited for) before any worker runs.")
app.add_typer(models_app, name="models")


@contextmanager
def _coordinator() -> Iterator[Coordinator]:
    """A coordinator, with every Redis error as a one-line CLI error."""
    settings = environment_settings()
    configure_logging(settings.log_level, settings.log_format)
    try:
        yield Coordinator(settings)
    except RedisError as exc:
        fail_redis(settings, exc)


def _row(listing: ModelListing) -> dict[str, Any]:
    """One model as ``list --json`` prints it (a URI's password masked)."""
    entry = listing.entry
    return {"name": listing.name, "declared": entry is not None,
            "live_workers": len(listing.workers), "starting_workers": len(listing.starting),
            "slots": sum(w.slots for w in listing.workers),
            "entry": None if entry is None else {**entry.model_dump(mode="json"),
                                                 "model": redact(entry.model)}}


@models_app.command("add")
def add(
    name: Annotated[str, typer.Argument(help="the name clients call the model by")],
    model: Annotated[str, typer.Option("--model", help="the GGUF path or URI its workers load")],
    alias: Annotated[list[str] | None, typer.Option(
        help="another name clients may use (repeatable)")] = None,
    ctx: Annotated[list[int] | None, typer.Option(
        help="a per-slot context its workers run with (repeatable: context tiers)")] = None,
    slots: Annotated[int | None, typer.Option(help="generation slots per worker")] = None,
    chat_template: Annotated[str | None, typer.Option(
        help="a named chat template its workers use (chatml, gemma, llama3)")] = None,
    device: Annotated[Literal["cpu", "cuda"] | None, typer.Option(
        help="the kind of device its workers run on")] = None,
    as_json: AsJson = False,
) -> None:
    """Declare a model (or redeclare it: its entry is replaced)."""
    fields: dict[str, Any] = {"name": name, "model": model, "aliases": alias or [],
                              "contexts": ctx or [], "slots": slots,
                              "chat_template": chat_template, "device": device}
    try:
        entry = ModelEntry(**fields)
    except ValidationError as exc:
        fail(describe_validation_error(exc, subject=None))
    with _coordinator() as coordinator:
        try:
            coordinator.models.catalog.declare(entry)
        except CatalogError as exc:
            fail(str(exc))
    if as_json:
        print(json.dumps({**entry.model_dump(mode="json"), "model": redact(entry.model)}))
    else:
        print(f"declared model '{entry.name}'"
              + (f" (aliases: {', '.join(entry.aliases)})" if entry.aliases else ""))


@models_app.command("list")
def list_models(as_json: AsJson = False) -> None:
    """Every model declared, served or loading, with its live and loading workers."""
    with _coordinator() as coordinator:
        listings = coordinator.models.listing()
    if as_json:
        print(json.dumps({"models": [_row(m) for m in listings]}))
        return
    table = Table("model", "declared", "live", "loading", "slots", "aliases", "loads")
    for m in listings:
        entry = m.entry
        table.add_row(m.name, "yes" if entry else "no", str(len(m.workers)),
                      str(len(m.starting)), str(sum(w.slots for w in m.workers)),
                      ", ".join(entry.aliases) if entry else "-",
                      redact(entry.model) if entry else "-")
    Console().print(table)


@models_app.command("remove")
def remove(name: Annotated[str, typer.Argument(help="a declared model's name")]) -> None:
    """Forget a declared model and its aliases (its workers, if any, serve on)."""
    with _coordinator() as coordinator:
        removed = coordinator.models.catalog.remove(name)
    if not removed:
        fail(f"model '{name}' is not declared", code=1)
    print(f"removed model '{name}'")
