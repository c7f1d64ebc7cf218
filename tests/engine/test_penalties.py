"""A request's bias and penalties as the device gets them (``Penalties``, kept as the history
grows, each row with the drafts before it) against the one decision made from scratch
(``adjustment``, what the host applies): the same value for every id, row by row, decode by
decode, with committed tokens arriving in between."""

from __future__ import annotations

import numpy as np
import pytest

from shared.protocol import SamplingParams
from worker.engine.penalties import Penalties, adjustment
from worker.llm.device_sampling import Adjustment

CASES = [SamplingParams(temperature=1.0, repetition_penalty=1.3),
         SamplingParams(temperature=1.0, presence_penalty=0.7, frequency_penalty=-0.3),
         SamplingParams(temperature=1.0, logit_bias={3: 5.0, 40: -100.0}),
         SamplingParams(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=0.2,
                        logit_bias={5: 2.0, 9: -1.5, 11: 0.5})]


def _by_id(a: Adjustment) -> dict[int, tuple[float, float, float]]:
    assert len(set(a.ids.tolist())) == len(a.ids), "an id twice"
    return {int(i): (float(b), float(p), float(m))
            for i, b, p, m in zip(a.ids, a.bias, a.penalty, a.minus, strict=True)}


@pytest.mark.parametrize("params", CASES, ids=["repetition", "presence+frequency", "bias",
                                               "all"])
def test_rows_kept_as_the_history_grows_are_the_ones_made_from_scratch(
        params: SamplingParams) -> None:
    """Decode after decode (a prompt, then verifies of a committed token and up to five
    drafts, then some of them committed; and a row of the history already committed), every
    row's adjustment gives every id the value the from-scratch one gives it, and changes no
    other id."""
    rng = np.random.default_rng(len(str(params)))
    history = rng.integers(0, 60, 25).tolist()
    n_prompt = len(history)
    penalties = Penalties(params, history, n_prompt)
    for _ in range(40):
        drafts = rng.integers(0, 60, int(rng.integers(0, 6))).tolist()
        start = len(history)
        batch = {start - 1: history[-1], **{start + i: t for i, t in enumerate(drafts)}}
        positions = [int(rng.integers(1, start)), *range(start, start + len(drafts) + 1)]
        rows = penalties.adjustments(positions, batch)
        for position, row in zip(positions, rows, strict=True):
            seen = [*history, *drafts][:position]
            assert _by_id(row) == _by_id(adjustment(params, seen, n_prompt)), position
        history += drafts[:int(rng.integers(0, len(drafts) + 1))] + [int(rng.integers(0, 60))]
