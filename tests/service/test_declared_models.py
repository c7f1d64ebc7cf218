"""Declared models, loading workers and the waits for them, against a real Redis: a model is
served, coming, known or unknown (``coordinator/models.py``), a request for a coming one waits
for a worker (and is recorded as waiting: the autoscaler's gauge), and one for a model nobody
declared or served is refused at once naming the known ones."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from helpers import specfleet
from prometheus_client.parser import text_string_to_metric_families

from coordinator.client import Coordinator
from coordinator.metrics import render_fleet_metrics
from coordinator.models import Standing
from coordinator.validation import SubmitError
from shared.catalog import CatalogError, ModelEntry
from shared.protocol import WorkerInfo
from shared.settings import Settings
from shared.starting import StartingRecord, starting_workers

REQUEST = {"model": "m", "prompt": "hello", "max_tokens": 4}


def _register(coordinator: Coordinator, name: str, model: str, n_ctx: int = 512) -> None:
    """A registration as a live worker writes it (what admission reads)."""
    now = time.time()
    coordinator.registry.register(WorkerInfo(
        name=name, model_name=model, model_path="/m.gguf", device="cpu", n_ctx=n_ctx,
        version="test", pid=1, host="h", started_at=now, heartbeat_at=now, slots=2))


def _queued(coordinator: Coordinator, model: str) -> int:
    return sum(coordinator.queue_depths(model).values())


def _gauges(coordinator: Coordinator) -> dict[tuple[str, str], float]:
    """Every per-model sample of the gateway's /metrics body: (name, model) -> value."""
    body = render_fleet_metrics(coordinator).decode()
    return {(s.name, s.labels["model"]): s.value
            for family in text_string_to_metric_families(body) for s in family.samples
            if set(s.labels) == {"model"}}


class Submits:
    """Submits run in threads; ``outcomes``: each one's job handle or SubmitError."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self.outcomes: list[object] = []
        self.threads: list[threading.Thread] = []

    def start(self, request: dict[str, object], wait_seconds: float) -> None:
        def run() -> None:
            try:
                self.outcomes.append(self.coordinator.submit(request, wait_seconds=wait_seconds))
            except SubmitError as exc:
                self.outcomes.append(exc)
        self.threads.append(threading.Thread(target=run))
        self.threads[-1].start()


@pytest.fixture
def submits(coordinator: Coordinator) -> Iterator[Submits]:
    s = Submits(coordinator)
    yield s
    for thread in s.threads:
        thread.join(timeout=30)


def _wait_until(predicate: Callable[[], bool], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_a_model_is_unknown_coming_served_then_known(coordinator: Coordinator) -> None:
    models = coordinator.models
    assert models.state("m").standing is Standing.UNKNOWN
    models.catalog.declare(ModelEntry(name="m", model="/models/m.gguf", aliases=["mm"]))
    coming = models.state("m")
    assert coming.standing is Standing.COMING and coming.why_coming() == "declared"
    _register(coordinator, "w1", "m")
    assert models.state("m").standing is Standing.SERVED
    coordinator.registry.deregister("w1")
    assert models.state("m").standing is Standing.COMING  # still declared
    assert models.catalog.remove("m") and not models.catalog.remove("m")
    assert models.state("m").standing is Standing.KNOWN  # it has had workers
    assert models.catalog.resolve("mm") is None  # its alias went with it


def test_names_and_aliases_mean_one_model_each(coordinator: Coordinator) -> None:
    catalog = coordinator.models.catalog
    catalog.declare(ModelEntry(name="a", model="/a.gguf", aliases=["x", "y"]))
    _register(coordinator, "w", "served")
    refusals = {
        "an alias of another": (ModelEntry(name="b", model="/b.gguf", aliases=["x"]),
                                "'x' is already an alias of model 'a'"),
        "a declared name": (ModelEntry(name="b", model="/b.gguf", aliases=["a"]),
                            "'a' is the name of a model"),
        "a served name": (ModelEntry(name="b", model="/b.gguf", aliases=["served"]),
                          "'served' is the name of a model"),
        "a name that is an alias": (ModelEntry(name="y", model="/y.gguf"),
                                    "'y' is an alias of model 'a'"),
    }
    for what, (entry, said) in refusals.items():
        with pytest.raises(CatalogError, match=said):
            catalog.declare(entry)
        assert catalog.get(entry.name) is None, what
    # redeclaring replaces the entry: the dropped alias is free again
    catalog.declare(ModelEntry(name="a", model="/a2.gguf", aliases=["y"]))
    assert catalog.resolve("x") is None and catalog.resolve("y") == "a"
    catalog.declare(ModelEntry(name="b", model="/b.gguf", aliases=["x"]))
    assert [e.name for e in catalog.entries()] == ["a", "b"]
    with pytest.raises(ValueError, match="the model's own name"):
        ModelEntry(name="c", model="/c.gguf", aliases=["c"])


def test_an_unknown_model_is_refused_at_once_naming_the_known(coordinator: Coordinator) -> None:
    coordinator.models.catalog.declare(ModelEntry(name="m", model="/m.gguf"))
    _register(coordinator, "w", "other")
    with pytest.raises(SubmitError) as refused:
        coordinator.submit({**REQUEST, "model": "nope"}, wait_seconds=60)
    assert refused.value.reason == "unknown_model"
    assert "unknown model 'nope' (known models: m, other;" in str(refused.value)


def test_a_coming_model_is_refused_coming_unless_waited_for(coordinator: Coordinator) -> None:
    coordinator.models.catalog.declare(ModelEntry(name="m", model="/m.gguf", contexts=[256]))
    with pytest.raises(SubmitError) as refused:
        coordinator.submit(REQUEST)
    assert refused.value.reason == "coming" and refused.value.model == "m"
    assert "no live worker serves model 'm' yet (declared)" in str(refused.value)
    # a request that cannot fit the declared contexts is not kept waiting for a worker
    with pytest.raises(SubmitError, match=r"exceeds the largest context declared for model "
                                          r"'m' \(256 tokens\)") as too_long:
        coordinator.submit({**REQUEST, "max_tokens": 300}, wait_seconds=60)
    assert too_long.value.reason == "context_length_exceeded"
    assert _queued(coordinator, "m") == 0


def test_a_wait_past_its_deadline_names_the_model_and_the_deadline(
        coordinator: Coordinator) -> None:
    coordinator.models.catalog.declare(ModelEntry(name="m", model="/m.gguf"))
    with pytest.raises(SubmitError) as late:
        coordinator.submit(REQUEST, wait_seconds=1)
    assert late.value.reason == "wait_timeout"
    assert ("no worker of model 'm' became live within 1 s "
            "(SPECFLEET_WAIT_FOR_WORKER_SECONDS)") in str(late.value)
    assert coordinator.waiting.of(["m"])["m"].requests == 0  # its record went with it
    assert _queued(coordinator, "m") == 0


def test_a_waiting_request_is_counted_then_queued_when_a_worker_registers(
        coordinator: Coordinator, submits: Submits) -> None:
    coordinator.models.catalog.declare(ModelEntry(name="m", model="/m.gguf", aliases=["mine"]))
    submits.start({**REQUEST, "model": "mine"}, 60)  # by its alias
    _wait_until(lambda: coordinator.waiting.of(["m"])["m"].requests == 1)
    gauges = _gauges(coordinator)
    assert gauges[("specfleet:model_waiting_requests", "m")] == 1
    assert gauges[("specfleet:model_demand_slots", "m")] == 1
    assert gauges[("specfleet:model_declared", "m")] == 1
    assert gauges[("specfleet:workers_live", "m")] == 0
    assert _queued(coordinator, "m") == 0
    _register(coordinator, "w", "m")
    _wait_until(lambda: bool(submits.outcomes))
    assert not isinstance(submits.outcomes[0], SubmitError), submits.outcomes[0]
    assert _queued(coordinator, "m") == 1  # queued as the model, not its alias
    gauges = _gauges(coordinator)
    assert gauges[("specfleet:model_waiting_requests", "m")] == 0
    assert gauges[("specfleet:model_queued_jobs", "m")] == 1
    assert gauges[("specfleet:model_free_slots", "m")] == 2


def test_a_loading_worker_makes_its_model_coming(coordinator: Coordinator,
                                                 submits: Submits) -> None:
    """What ``specfleet worker`` writes while it loads (``StartingRecord``) makes a model
    nobody declared coming: a request waits for it instead of being refused unknown; its
    registration ends the record, and a worker that dies loading stops being awaited."""
    settings = coordinator.settings
    with StartingRecord(coordinator.connection, settings.keys, "fresh", "w-fresh",
                        ttl_seconds=30.0, interval_seconds=0.2):
        assert starting_workers(coordinator.connection, settings.keys) == {"fresh": ["w-fresh"]}
        state = coordinator.models.state("fresh")
        assert state.standing is Standing.COMING and state.starting == ["w-fresh"]
        submits.start({**REQUEST, "model": "fresh"}, 60)
        _wait_until(lambda: coordinator.waiting.of(["fresh"])["fresh"].requests == 1)
        assert _gauges(coordinator)[("specfleet:model_starting_workers", "fresh")] == 1
    _register(coordinator, "w-fresh", "fresh")  # as the worker does once loaded
    assert starting_workers(coordinator.connection, settings.keys) == {}
    _wait_until(lambda: bool(submits.outcomes))
    assert not isinstance(submits.outcomes[0], SubmitError), submits.outcomes[0]
    with StartingRecord(coordinator.connection, settings.keys, "doomed", "w-doomed",
                        ttl_seconds=0.5, interval_seconds=0.1):
        assert coordinator.models.state("doomed").standing is Standing.COMING
    # it never registers: its record lapses within its TTL, and the model is unknown again
    _wait_until(lambda: coordinator.models.state("doomed").standing is Standing.UNKNOWN)


def test_the_models_command_declares_lists_and_removes(settings: Settings) -> None:
    env = {**os.environ, "REDIS_URL": settings.redis_url, "SPECFLEET_PREFIX": settings.prefix,
           "SPECFLEET_LOG_LEVEL": "warning", "SPECFLEET_WAIT_FOR_WORKER_SECONDS": "1"}
    added = specfleet("models", "add", "m", "--model", "https://u:secret@host/m.gguf",
                      "--alias", "mm", "--ctx", "1024", "--ctx", "512", "--device", "cpu",
                      "--json", env=env)
    assert added.returncode == 0, added.stderr
    entry = json.loads(added.stdout)
    assert entry["aliases"] == ["mm"] and entry["contexts"] == [512, 1024]
    assert "secret" not in added.stdout  # a URI's password is never printed
    listed = specfleet("models", "list", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    [row] = json.loads(listed.stdout)["models"]
    assert (row["name"], row["declared"], row["live_workers"]) == ("m", True, 0)
    taken = specfleet("models", "add", "other", "--model", "/o.gguf", "--alias", "mm", env=env)
    assert taken.returncode == 2
    assert "specfleet: error: aliases: 'mm' is already an alias of model 'm'" in taken.stderr
    bad = specfleet("models", "add", "a/b", "--model", "/o.gguf", env=env)
    assert bad.returncode == 2 and "name:" in bad.stderr
    # a submit for the declared model waits for a worker, then says how long it waited
    waited = specfleet("submit", "--model", "mm", "--prompt", "x", "--max-tokens", "2", env=env)
    assert waited.returncode == 2
    assert "no worker of model 'm' became live within 1 s" in waited.stderr
    assert specfleet("models", "remove", "m", env=env).returncode == 0
    gone = specfleet("models", "remove", "m", env=env)
    assert gone.returncode == 1 and "model 'm' is not declared" in gone.stderr
