"""``/v1/models`` (every model declared, served or loading, with its live workers) and the
declared models' admin routes, ``/v1/specfleet/models``.

What a model is and whether it can be served is :class:`coordinator.models.ModelDirectory`'s;
these routes only show it. Declaring and removing models changes what every gateway and
client of the deployment accepts, so on a gateway with API keys only an admin key may
(``request.state.operator``, decided by ``auth.ApiKeys``); an open gateway lets anyone, as
it lets anyone submit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError

from coordinator.client import Coordinator
from coordinator.gateway.errors import APIError, from_validation
from coordinator.gateway.routes import json_body
from coordinator.models import ModelListing
from shared.catalog import CatalogError, ModelEntry
from shared.logs import get_logger
from shared.protocol import WorkerInfo
from shared.redact import redact

router = APIRouter()
log = get_logger("gateway")


def _coordinator(request: Request) -> Coordinator:
    return request.app.state.coordinator


def _model_object(listing: ModelListing, aliases: Sequence[str]) -> dict[str, Any]:
    """One model: its aliases (the gateway's and the declared ones), whether it is declared,
    its live and loading workers and their capacity (a declared model with none shows what
    it is declared with)."""
    ws, entry = listing.workers, listing.entry
    created = min((w.started_at for w in ws), default=entry.declared_at if entry else 0.0)
    templates = sorted({w.chat_template_source for w in ws if w.chat_template_source})
    declared_ctx = max(entry.contexts) if entry and entry.contexts else None
    return {"id": listing.name, "object": "model", "created": int(created),
            "owned_by": "specfleet",
            "specfleet": {"slots": sum(w.slots for w in ws),
                          "max_context": max((w.n_ctx for w in ws), default=declared_ctx),
                          "chat_template": any(w.chat_template for w in ws),
                          "chat_templates": templates,
                          "vocab_size": min((w.n_vocab for w in ws if w.n_vocab), default=None),
                          "spec_methods": sorted({m for w in ws for m in w.spec_methods}),
                          "alias_of": None, "aliases": list(aliases),
                          "declared": entry is not None, "live_workers": len(ws),
                          "starting_workers": len(listing.starting),
                          "workers": [_capacity(w) for w in ws]}}


def _capacity(worker: WorkerInfo) -> dict[str, Any]:
    """What one worker can serve: its context, slots, device and speculative capacity."""
    return {"name": worker.name, "device": worker.device, "n_ctx": worker.n_ctx,
            "slots": worker.slots, "chat_template": worker.chat_template,
            "chat_template_source": worker.chat_template_source, "n_vocab": worker.n_vocab,
            "embedding_tokens": worker.embedding_tokens,
            "capacity": worker.capacity.model_dump(mode="json") if worker.capacity else None}


def _aliases(request: Request, listings: list[ModelListing]) -> dict[str, str]:
    """Every alias a client may use: the gateway's (``--model-alias``) and the declared."""
    declared = {a: m.name for m in listings if m.entry for a in m.entry.aliases}
    return {**declared, **request.app.state.aliases}


async def _model_objects(request: Request) -> tuple[list[dict[str, Any]], dict[str, str]]:
    listings = await asyncio.to_thread(_coordinator(request).models.listing)
    aliases = _aliases(request, listings)
    return [_model_object(m, sorted(a for a, target in aliases.items() if target == m.name))
            for m in listings], aliases


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    """Every model declared, served or loading, one entry each with its aliases (as
    llama-server and vLLM list them) and its live workers' count and capacity."""
    objects, _ = await _model_objects(request)
    return {"object": "list", "data": objects}


@router.get("/v1/models/{model_id}")
async def model(request: Request, model_id: str) -> dict[str, Any]:
    """One model, or an alias of one (its own id, ``specfleet.alias_of``)."""
    objects, aliases = await _model_objects(request)
    target = aliases.get(model_id, model_id)
    found = [m for m in objects if m["id"] == target]
    if not found:
        raise APIError(404, f"no model '{model_id}' is declared or served", "not_found_error",
                       param="model", code="model_not_found")
    if target == model_id:
        return found[0]
    return {**found[0], "id": model_id,
            "specfleet": {**found[0]["specfleet"], "alias_of": target, "aliases": []}}


def _operator(request: Request) -> None:
    """403 unless the caller may change the declared models."""
    if not request.state.operator:
        raise APIError(403, "declaring models needs an admin API key "
                       "(SPECFLEET_ADMIN_API_KEYS)", "permission_error",
                       code="admin_key_required")


@router.get("/v1/specfleet/models")
async def declared(request: Request) -> dict[str, Any]:
    """The declared models as declared (what their workers are started with)."""
    _operator(request)
    entries = await asyncio.to_thread(_coordinator(request).models.catalog.entries)
    return {"object": "list", "data": [e.model_dump(mode="json") for e in entries]}


@router.post("/v1/specfleet/models")
async def declare(request: Request) -> dict[str, Any]:
    """Declare a model (or redeclare it: its entry is replaced); the body is its entry."""
    _operator(request)
    body = await json_body(request)
    body.pop("declared_at", None)  # stamped here
    try:
        entry = ModelEntry.model_validate(body)
    except ValidationError as exc:
        raise from_validation(exc) from None
    try:
        await asyncio.to_thread(_coordinator(request).models.catalog.declare, entry)
    except CatalogError as exc:
        raise APIError(400, str(exc), param=exc.param, code="model_name_taken") from None
    log.info("model.declared", model=entry.name, aliases=entry.aliases,
             path=redact(entry.model))
    return entry.model_dump(mode="json")


@router.delete("/v1/specfleet/models/{name}")
async def remove(request: Request, name: str) -> dict[str, Any]:
    """Forget a declared model (its workers, if any, serve on)."""
    _operator(request)
    if not await asyncio.to_thread(_coordinator(request).models.catalog.remove, name):
        raise APIError(404, f"model '{name}' is not declared", "not_found_error",
                       param="name", code="model_not_found")
    log.info("model.removed", model=name)
    return {"id": name, "object": "model", "deleted": True}
