"""The contexts an engine will create, as :class:`ContextSpec` values the fitter can measure.

The fitter must measure exactly what the engine later allocates, so every decision comes from
the engine's own code: the method from ``resolve_engine_method``, ``n_rs_seq`` from the rollback
policy ``make_rollback`` picks, and the context specs from ``worker.engine.config``, which the
engine builds its contexts from too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shared.protocol import SpecMethod
from worker.engine.config import EngineConfig, draft_spec, target_spec
from worker.engine.proposers.factory import resolve_engine_method, uses_mtp
from worker.engine.rollback import make_rollback
from worker.engine.rollback.compact import CompactRollback
from worker.llm import ContextSpec, Model


@dataclass(frozen=True)
class EngineSpecs:
    """Everything that decides an engine's memory, for one context size ``target.n_ctx``."""

    method: SpecMethod
    draft_max: int
    #: Rollback snapshots per sequence the target is created with (D, or N for D = N).
    n_rs_seq: int
    #: True when rollback keeps fewer snapshots than the draft maximum and guards longer
    #: drafts with a checkpoint (compact rollback): then every slot needs checkpoint storage.
    checkpoints: bool
    target: ContextSpec
    draft: ContextSpec | None
    #: What the specs were derived from: :meth:`at` derives them again for another size.
    config: EngineConfig

    @property
    def slots(self) -> int:
        """Sequences served at once; ``target.n_ctx`` is ``slots`` x the per-slot context."""
        return self.config.slots

    def at(self, n_ctx: int) -> EngineSpecs:
        """The same engine with another per-slot context size, through the engine's own spec
        functions, so how a field follows ``n_ctx`` is decided in one place."""
        config = replace(self.config, n_ctx=n_ctx)
        return replace(self, config=config,
                       target=target_spec(config, self.n_rs_seq, self.draft_max),
                       draft=(draft_spec(config, self.draft_max)
                              if self.draft is not None else None))


def engine_specs(config: EngineConfig, model: Model) -> EngineSpecs:
    """The target (and MTP draft) context specs of an engine built from ``config``
    (``config.slots`` sequences of ``config.n_ctx`` tokens each)."""
    method = resolve_engine_method(config.spec.method, model)
    draft_max = config.spec.draft_max if method is not SpecMethod.NONE else 0
    rollback = make_rollback(model, draft_max, config.spec.rollback_depth, config.checkpoint,
                             config.fail_device_checkpoint)
    rollback.close()  # asked only for n_rs_seq and its kind; it never serves a context
    target = target_spec(config, rollback.n_rs_seq, draft_max)
    draft = draft_spec(config, draft_max) if uses_mtp(method) else None
    return EngineSpecs(method, draft_max, rollback.n_rs_seq,
                       isinstance(rollback, CompactRollback), target, draft, config)
