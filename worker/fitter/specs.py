"""The contexts an engine will create, as :class:`ContextSpec` values the fitter can measure.

The fitter must measure exactly what the engine later allocates, so every decision comes from
the engine's own code: the plan from :func:`worker.engine.plan.plan_engine` (method, draft
width, ``n_rs_seq``, checkpoints; nothing is allocated to find out), and the context specs
from ``worker.engine.config``, which the engine builds its contexts from too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from worker.engine.config import EngineConfig, draft_spec, embedding_spec, target_spec
from worker.engine.plan import EnginePlan, ModelFacts, plan_engine
from worker.llm import ContextSpec


@dataclass(frozen=True)
class EngineSpecs:
    """Everything that decides an engine's memory, for one context size ``target.n_ctx``."""

    plan: EnginePlan
    target: ContextSpec
    draft: ContextSpec | None
    #: The embedding context (``EngineConfig.embedding_tokens``; None: none), whatever the
    #: target's size.
    embedding: ContextSpec | None
    #: What the specs were derived from: :meth:`at` derives them again for another size.
    config: EngineConfig

    @property
    def slots(self) -> int:
        """Sequences served at once; ``target.n_ctx`` is ``slots`` x the per-slot context."""
        return self.plan.slots

    def at(self, n_ctx: int) -> EngineSpecs:
        """The same engine with another per-slot context size, through the engine's own spec
        functions, so how a field follows ``n_ctx`` is decided in one place."""
        return _specs(self.plan, replace(self.config, n_ctx=n_ctx))


def engine_specs(config: EngineConfig, model: ModelFacts) -> EngineSpecs:
    """The target (and MTP draft) context specs of an engine built from ``config``
    (``config.slots`` sequences of ``config.n_ctx`` tokens each) on ``model``."""
    return _specs(plan_engine(config, model), config)


def _specs(plan: EnginePlan, config: EngineConfig) -> EngineSpecs:
    return EngineSpecs(plan, target_spec(config, plan.n_rs_seq, plan.draft_max,
                                         plan.device_verify),
                       draft_spec(config, plan.draft_max) if plan.mtp else None,
                       embedding_spec(config), config)
