"""Model fixtures shared by every test, and the rule that puts each test in its tier.

The tiny GGUFs are written once per session. Gemma fixtures skip (with the install hint) when
the demo extra is missing; the F16 copy is cached in ``$SPECFLEET_CACHE_DIR`` (default
``~/.cache/specfleet``), so only the first run pays for the conversion.

Tiers: ``make test`` runs everything (CI); ``make test-fast`` (``-m "not slow"``) leaves out
the tests marked ``slow``. A test is marked ``slow`` here, from what it uses, never by hand:
when it, or any fixture it requests (transitively), names one of :data:`SLOW_USES` (worker
fleets, gateway processes, a Redis replica group, Gemma, statistical samples), or is marked
``gemma``. So a new test lands in the right tier by using those helpers; an in-process test
or one that runs a single short process stays fast.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Generator, Iterator
from pathlib import Path
from types import CodeType
from typing import Any

import pytest

from worker.testmodels import TinyModels, build_tiny_models, gemma

#: Names whose use makes a test slow: they start worker processes (``Fleet``, ``live_run``),
#: a gateway process (``Gateway``, or a worker and a gateway: ``deployed``), a private
#: ``redis-server`` to stop, restart or refuse (``private_redis``: test_secrets runs fourteen
#: commands against one), a Redis replica group with a sentinel, a compose stack
#: (``compose_stack``), load Gemma 3 270M, draw a statistical sample of thousands of
#: generations (``plain_sample``), run a bench script end to end (``run_bench``), or start
#: RPC device processes (``rpc_devices``).
SLOW_USES = frozenset({"Fleet", "Gateway", "deployed", "live_run", "private_redis",
                       "sentinel_group", "compose_stack", "gemma_path", "gemma_f16_path",
                       "plain_sample", "run_bench", "rpc_devices"})


def _names(code: CodeType) -> Iterator[str]:
    """The global and attribute names a function's code uses, nested functions included."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, CodeType):
            yield from _names(const)


def _uses(item: pytest.Item) -> set[str]:
    """What a test names: its fixtures (transitively) and the names in its and their code."""
    names = set(getattr(item, "fixturenames", ()))
    functions: list[Any] = [getattr(item, "function", None)]
    info = getattr(item, "_fixtureinfo", None)
    if info is not None:
        functions += [d.func for defs in info.name2fixturedefs.values() for d in defs]
    for function in functions:
        code = getattr(function, "__code__", None)
        if code is not None:
            names.update(_names(code))
    return names


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``slow`` every test that uses one of :data:`SLOW_USES` (the tier rule above)."""
    for item in items:
        if _uses(item) & SLOW_USES or item.get_closest_marker("gemma") is not None:
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item,
                              call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    """A failed test's report carries the log tails of the worker fleets running then
    (``service.workers.Fleet.running``): they are all a CI run leaves of what a worker did.
    A worker still running when the test failed first dumps its threads' stacks there."""
    outcome = yield
    report = outcome.get_result()
    workers = sys.modules.get("service.workers")
    if report.failed and report.when == "call" and workers is not None:
        for fleet in workers.Fleet.running:
            fleet.dump_stacks()
            for name, text in fleet.log_tails():
                report.sections.append((f"worker {name}: log tail", text))


def pytest_configure(config: pytest.Config) -> None:
    """Every process the suite starts keeps its row-cost curves in a directory of this run
    (``SPECFLEET_COST_CACHE_DIR``), never in the user's cache: no test meets a curve an
    earlier run timed (``service.workers.Fleet`` gives each test's workers their own)."""
    os.environ["SPECFLEET_COST_CACHE_DIR"] = tempfile.mkdtemp(prefix="specfleet-rowcosts-")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    """All tiny models (dense llama, qwen35 with MTP head, head-less twin, SWA gemma3), seed 0."""
    return build_tiny_models(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="session")
def dense_model(tiny_models: TinyModels) -> Path:
    """Dense ``llama``: KV cache only, no rollback support (n_rs_seq is granted as 0)."""
    return tiny_models.dense


@pytest.fixture(scope="session")
def hybrid_model(tiny_models: TinyModels) -> Path:
    """Hybrid ``qwen35`` with one NextN (MTP) layer; load with ``load_mtp=True`` to draft."""
    return tiny_models.hybrid


@pytest.fixture(scope="session")
def headless_model(tiny_models: TinyModels) -> Path:
    """The hybrid's trunk without an MTP head: for the "model has no MTP head" paths."""
    return tiny_models.headless


@pytest.fixture(scope="session")
def swa_model(tiny_models: TinyModels) -> Path:
    """``gemma3`` with a 32-token sliding window on layers 0-4 and a global layer 5 (Gemma 3's
    interleaving): the SWA cache overwrites old cells when the context has ``swa_full=False``."""
    return tiny_models.swa


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    """Gemma 3 270M Q4_K_M (demo extra)."""
    try:
        return gemma.gemma_q4_path()
    except gemma.GemmaUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def gemma_f16_path(gemma_path: Path) -> Path:
    """The F16 copy of Gemma 3 270M: batch-invariant enough for exactness gates."""
    return gemma.gemma_f16_path()
