"""One path for every telemetry count: declared once, summed, exported and tallied the same way.

A count is a ``Summed`` field of :class:`Telemetry` (shared/protocol.py) with a source in the
engine's counters (``SpecCounters`` or ``RollbackStats``). These tests drive the real parts:
the engine's merge and rendering, a worker's Prometheus registry and the log monitor's tally,
each fed telemetry where every count has its own value, so a count dropped on any of the
paths shows up as a wrong or missing number, named.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from coordinator.monitor import Tally
from shared.protocol import Telemetry
from worker.engine.core.telemetry import SUMMED_FIELDS, SpecCounters, count, merge_rules
from worker.engine.rollback.base import RollbackStats
from worker.service.metrics import PREFIX, WorkerMetrics

_LABELS = {"worker": "w", "model": "m", "device": "cpu", "method": "ngram"}


def _rollback_counts() -> set[str]:
    return {f.name for f in dataclasses.fields(RollbackStats) if f.metadata.get("count")}


def _distinct(i: int, default: Any) -> Any:
    """A value of ``default``'s type that no other field gets."""
    if isinstance(default, list):
        return [i + 1, i + 2]
    return type(default)(i + 1) + (0.25 if isinstance(default, float) else 0)


def _telemetry() -> Telemetry:
    """Telemetry with every summed field set to its own value."""
    values = {name: _distinct(i, Telemetry.model_fields[name].get_default(
        call_default_factory=True)) for i, name in enumerate(Telemetry.summed())}
    return Telemetry(spec_method="ngram", host_fallback_reason="fault_injection", **values)


def test_every_summed_telemetry_field_has_a_source_in_the_engine() -> None:
    sources = set(SUMMED_FIELDS) | _rollback_counts()
    missing = sorted(set(Telemetry.summed()) - sources)
    assert not missing, (f"Telemetry fields marked Summed that no engine counter feeds: "
                         f"{missing}; add each to SpecCounters with count() (or RollbackStats)")
    unmarked = sorted(sources - set(Telemetry.summed()))
    assert not unmarked, (f"engine counters that Telemetry does not mark Summed (so metrics "
                          f"and the monitor never see them): {unmarked}")


def test_every_summed_field_has_a_prometheus_series_counting_it() -> None:
    metrics = WorkerMetrics("w", "m", "cpu")
    telemetry = _telemetry()
    metrics.job_started("j")
    metrics.job_finished("j", telemetry, "finished")
    wrong = []
    for name, rule in Telemetry.summed().items():
        value = getattr(telemetry, name)
        series = f"{PREFIX}{rule.series}_total"
        if isinstance(value, list):
            got: Any = [metrics.registry.get_sample_value(
                series, {**_LABELS, "position": str(p)}) for p in range(len(value))]
        elif rule.label_field:
            got = metrics.registry.get_sample_value(
                series, {**_LABELS, rule.label or "": getattr(telemetry, rule.label_field)})
        else:
            got = metrics.registry.get_sample_value(series, _LABELS)
        if got != value:
            wrong.append(f"{name} -> {series}: {got} (expected {value})")
    assert not wrong, "series that do not count their Telemetry field:\n" + "\n".join(wrong)


def test_merge_sums_every_counter_and_renders_it_by_name() -> None:
    def counters(offset: int) -> SpecCounters:
        c = SpecCounters()
        for i, name in enumerate(SUMMED_FIELDS):
            setattr(c, name, _distinct(i + offset, getattr(c, name)))
        c.rollback = RollbackStats(**{n: offset + i for i, n in enumerate(_rollback_counts())})
        return c

    total, one, two = SpecCounters(), counters(0), counters(100)
    total.merge(one)
    total.merge(two)
    got = total.to_telemetry()
    a, b = one.to_telemetry(), two.to_telemetry()
    for name in Telemetry.summed():
        x, y = getattr(a, name), getattr(b, name)
        expected = [p + q for p, q in zip(x, y, strict=True)] if isinstance(x, list) else x + y
        assert getattr(got, name) == expected, name
    # the rendered lists are copies: a later verify does not rewrite a sent event
    got.drafted_per_position.append(7)
    assert total.drafted_per_position != got.drafted_per_position


def test_a_counter_without_a_merge_rule_is_refused_at_import() -> None:
    @dataclasses.dataclass
    class Counters:
        drafts: int = count()
        cached_tokens: int = 0

    with pytest.raises(TypeError, match=r"Counters\.cached_tokens declares no merge rule"):
        merge_rules(Counters)


def test_the_monitor_sums_every_summed_field_from_the_events() -> None:
    tally = Tally()
    telemetry = _telemetry()
    for _ in range(2):
        tally.add_telemetry(telemetry.model_dump(mode="json"))
    summary = tally.to_json()
    # host fallbacks are tallied from checkpoint.fallback events, by reason
    for name in set(Telemetry.summed()) - {"host_fallbacks"}:
        value = getattr(telemetry, name)
        expected = [2 * v for v in value] if isinstance(value, list) else 2 * value
        assert summary[name] == expected, name
