"""Whether a model is served, coming, known or unknown: the one rule every caller uses.

The CLI, the client's admission (``validation.py``), the gateway's ``/v1/models`` and its
waits, the batch pump and the fleet metrics all ask :class:`ModelDirectory`:

- **served**: a worker of it is live (its registration has not lapsed);
- **coming**: none is live, but it is declared (``shared/catalog.py``) or a worker of it is
  loading (``shared/starting.py``): a request for it waits for a worker, up to
  ``SPECFLEET_WAIT_FOR_WORKER_SECONDS``, instead of failing;
- **known**: none is live or coming, but it has had workers (``Keys.models``): a request is
  refused 503 (``SPECFLEET_REQUIRE_LIVE_WORKER``), a batch line waits for the batch's window;
- **unknown**: none of these: refused at once, naming the models that are known.

The common case costs nothing: a model with live workers is served, and nothing else is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from redis import Redis

from shared.catalog import ModelCatalog, ModelEntry
from shared.keys import Keys
from shared.protocol import WorkerInfo
from shared.registry import FleetRegistry
from shared.replies import text
from shared.starting import starting_workers


class Standing(StrEnum):
    SERVED = "served"
    COMING = "coming"
    KNOWN = "known"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class ModelState:
    """One model as the fleet stands now: its standing, live workers, declaration and the
    workers loading it."""

    name: str
    standing: Standing
    workers: list[WorkerInfo] = field(default_factory=list)
    entry: ModelEntry | None = None
    starting: list[str] = field(default_factory=list)

    def why_coming(self) -> str:
        """What a coming model is awaited on, for messages: declared, workers loading."""
        reasons = ["declared"] if self.entry is not None else []
        if self.starting:
            reasons.append(f"worker {', '.join(sorted(self.starting))} loading")
        return " and ".join(reasons)


@dataclass(frozen=True)
class ModelListing:
    """A model ``/v1/models``, ``specfleet models list`` and the metrics show: every model
    declared, served or loading."""

    name: str
    workers: list[WorkerInfo]
    entry: ModelEntry | None
    starting: list[str]


class ModelDirectory:
    """Reads the registry, the catalog and the starting records of one deployment."""

    def __init__(self, connection: Redis, keys: Keys, registry: FleetRegistry) -> None:
        self._conn = connection
        self._keys = keys
        self._registry = registry
        self.catalog = ModelCatalog(connection, keys)

    def state(self, model: str, workers: list[WorkerInfo] | None = None) -> ModelState:
        """Where ``model`` stands; ``workers`` are its live workers when the caller has just
        read them (read here otherwise)."""
        if workers is None:
            workers = self._registry.live_workers(model)
        if workers:
            return ModelState(model, Standing.SERVED, workers)
        entry = self.catalog.get(model)
        starting = starting_workers(self._conn, self._keys).get(model, [])
        if entry is not None or starting:
            return ModelState(model, Standing.COMING, entry=entry, starting=starting)
        if self._conn.sismember(self._keys.models(), model):
            return ModelState(model, Standing.KNOWN)
        return ModelState(model, Standing.UNKNOWN)

    def known(self) -> list[str]:
        """Every model a request may name: declared, loading, or that has had workers."""
        seen = {text(m) for m in self._conn.smembers(self._keys.models())}
        declared = {e.name for e in self.catalog.entries()}
        return sorted(seen | declared | set(starting_workers(self._conn, self._keys)))

    def listing(self, workers: list[WorkerInfo] | None = None) -> list[ModelListing]:
        """Every model that is declared, served or loading, by name (``workers``: every live
        worker when the caller has them)."""
        if workers is None:
            workers = self._registry.live_workers()
        served: dict[str, list[WorkerInfo]] = {}
        for w in workers:
            served.setdefault(w.model_name, []).append(w)
        entries = {e.name: e for e in self.catalog.entries()}
        starting = starting_workers(self._conn, self._keys)
        return [ModelListing(name, served.get(name, []), entries.get(name),
                             starting.get(name, []))
                for name in sorted(served.keys() | entries.keys() | starting.keys())]
