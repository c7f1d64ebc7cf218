"""The fitter measures the very contexts the engine creates: a drift here voids every fit."""

from __future__ import annotations

import pytest

from shared.protocol import SpecMethod
from worker.engine.engine import EngineConfig, SpeculativeEngine
from worker.engine.plan import ModelFacts
from worker.engine.proposers.mtp import MtpDrafter
from worker.fitter.specs import engine_specs
from worker.launch import EngineCapacity
from worker.testmodels import TinyModels


@pytest.mark.parametrize(("which", "capacity"), [
    ("dense", EngineCapacity(method=SpecMethod.NGRAM, draft_max=6)),
    ("hybrid", EngineCapacity(method=SpecMethod.NGRAM, draft_max=3)),
    ("hybrid", EngineCapacity(method=SpecMethod.MTP, draft_max=5, rollback_depth=2)),
    ("hybrid", EngineCapacity(method=SpecMethod.NONE)),
])
def test_specs_equal_the_engines_contexts(tiny_models: TinyModels, which: str,
                                          capacity: EngineCapacity) -> None:
    config = EngineConfig(model_path=str(getattr(tiny_models, which)), n_ctx=512,
                          capacity=capacity)
    with SpeculativeEngine(config) as engine:
        specs = engine_specs(config, ModelFacts.of(engine.model))
        assert specs.target == engine.target.spec
        assert specs.plan == engine.plan
        assert specs.plan.n_rs_seq == engine.target.n_rs_seq
        head = engine.head
        draft = head._draft.spec if isinstance(head, MtpDrafter) else None  # noqa: SLF001
        assert specs.draft == draft
        assert specs.at(1024).target == specs.target.with_(n_ctx=1024)
