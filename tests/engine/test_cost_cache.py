"""Row-cost curves kept between starts: a second engine of the same model, threads and build
reads the curve the first one timed; anything the curve depends on that differs is a miss; a
curve timed on a busy host, or one that lacks a width this engine can time, is not used."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.protocol import SpecMethod
from worker.engine.drafting import cache as cost_cache
from worker.engine.drafting.cache import CostCache, curve_key
from worker.engine.drafting.curve import CostCurve
from worker.engine.engine import EngineConfig, SpeculativeEngine
from worker.launch import EngineCapacity


def _engine(model: Path, cache: Path, threads: int = 1, draft_max: int = 7,
            slots: int = 1) -> SpeculativeEngine:
    return SpeculativeEngine(EngineConfig(
        str(model), n_ctx=256, slots=slots, n_threads=threads,
        capacity=EngineCapacity(method=SpecMethod.SUFFIX, draft_max=draft_max),
        cost_cache=str(cache)))


@pytest.fixture
def quiet_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every host counts as quiet (the suite runs beside itself: a curve timed then would
    not be stored, which the last test covers)."""
    monkeypatch.setattr(cost_cache, "QUIET_CORES", float("inf"))


@pytest.mark.usefixtures("quiet_host")
def test_a_second_start_reads_the_curve_the_first_timed(dense_model: Path,
                                                        tmp_path: Path) -> None:
    with _engine(dense_model, tmp_path) as first:
        timed = first.curve
        key = curve_key(first.model, 1, first.target.spec.n_ubatch, False)
    assert timed is not None and len(list(tmp_path.iterdir())) == 1
    assert CostCache(tmp_path).load(key) == timed
    with _engine(dense_model, tmp_path) as second:
        assert second.curve == timed  # read, not timed: the same numbers
    with _engine(dense_model, tmp_path, threads=2) as other:
        assert other.curve != timed  # another thread count is another curve
    assert len(list(tmp_path.iterdir())) == 2


@pytest.mark.usefixtures("quiet_host")
def test_a_stored_curve_that_lacks_a_width_is_timed_again(dense_model: Path,
                                                          tmp_path: Path) -> None:
    """A curve timed where only two output rows fit cannot price a wider engine's rows."""
    with _engine(dense_model, tmp_path, draft_max=1) as narrow:
        assert narrow.curve is not None and sorted(narrow.curve.timed) == [1, 2]
    with _engine(dense_model, tmp_path, draft_max=7, slots=2) as wide:
        assert wide.curve is not None and max(wide.curve.timed) == 16
    with _engine(dense_model, tmp_path, draft_max=1) as again:
        assert again.curve is not None and max(again.curve.timed) == 16  # the wider one


def test_a_curve_timed_on_a_busy_host_is_not_kept(dense_model: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cost_cache, "QUIET_CORES", -1.0)  # every host is busy
    with _engine(dense_model, tmp_path):
        pass
    assert not list(tmp_path.iterdir())


def test_an_unreadable_or_foreign_file_is_a_miss(tmp_path: Path) -> None:
    cache = CostCache(tmp_path)
    key = {"schema": 1, "model": "m"}
    cache.save(key, CostCurve({1: 1.0}))
    assert cache.load(key) == CostCurve({1: 1.0})
    [path] = tmp_path.iterdir()
    path.write_text("{not json")
    assert cache.load(key) is None
    path.write_text('{"key": {"schema": 1, "model": "other"}, "curve": {"timed": {"1": 1}}}')
    assert cache.load(key) is None
