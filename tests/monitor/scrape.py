"""Reading a Prometheus text exposition back into numbers the tests can compare."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample as (name, labels, value)."""
    return [(s.name, dict(s.labels), s.value)
            for family in text_string_to_metric_families(text) for s in family.samples]


def total(text: str, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    return sum(v for n, lab, v in samples(text)
               if n == name and all(lab.get(k) == want for k, want in labels.items()))


def by_label(text: str, name: str, label: str) -> dict[str, float]:
    """Samples called ``name`` summed per value of ``label``."""
    out: dict[str, float] = {}
    for n, lab, v in samples(text):
        if n == name and label in lab:
            out[lab[label]] = out.get(lab[label], 0.0) + v
    return out
