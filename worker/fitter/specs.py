"""The contexts an engine will create, as :class:`ContextSpec` values the fitter can measure.

The fitter must measure exactly what the engine later allocates. The engine builds its target
context in ``SpeculativeEngine.__init__`` and its MTP draft context in ``MtpProposer``; this
module mirrors those two constructors, taking every decision that can be shared from the
engine itself (the method from ``resolve_engine_method``, ``n_rs_seq`` from the rollback
policy ``make_rollback`` picks, the batch widths from the engine's constants). The engine
should build its contexts from :func:`engine_specs` too, so that both share one definition.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.protocol import SpecMethod
from worker.engine.engine import TARGET_UBATCH, EngineConfig
from worker.engine.proposers.factory import needs_mtp_weights, resolve_engine_method
from worker.engine.proposers.mtp import DRAFT_BATCH
from worker.engine.rollback import make_rollback
from worker.engine.rollback.compact import CompactRollback
from worker.llm import ContextSpec, Model, ModelSpec


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

    def at(self, n_ctx: int) -> EngineSpecs:
        """The same engine with another context size (the draft context follows the target)."""
        return EngineSpecs(
            self.method, self.draft_max, self.n_rs_seq, self.checkpoints,
            self.target.with_(n_ctx=n_ctx, n_batch=n_ctx),
            self.draft.with_(n_ctx=n_ctx) if self.draft is not None else None,
        )


def model_spec(config: EngineConfig, no_alloc: bool = False) -> ModelSpec:
    """How the engine loads its model (``no_alloc``: the fitter's metadata-only twin)."""
    return ModelSpec(config.model_path, load_mtp=needs_mtp_weights(config.spec.method),
                     n_gpu_layers=config.n_gpu_layers, no_alloc=no_alloc)


def engine_specs(config: EngineConfig, model: Model, slots: int = 1) -> EngineSpecs:
    """The target (and MTP draft) context specs of an engine built from ``config``.

    ``slots`` sequences share the target context (``n_seq_max``); today's engine serves one.
    """
    method = resolve_engine_method(config.spec.method, model)
    draft_max = config.spec.draft_max if method is not SpecMethod.NONE else 0
    rollback = make_rollback(model, draft_max, config.spec.rollback_depth, config.checkpoint,
                             config.fail_device_checkpoint)
    target = ContextSpec(
        n_ctx=config.n_ctx, n_batch=config.n_ctx, n_ubatch=TARGET_UBATCH, n_seq_max=slots,
        n_rs_seq=rollback.n_rs_seq, n_outputs_max=draft_max + 1, n_threads=config.n_threads,
        swa_full=False)
    draft = None
    if method is SpecMethod.MTP:
        draft = ContextSpec(n_ctx=config.n_ctx, n_batch=DRAFT_BATCH, n_ubatch=DRAFT_BATCH,
                            n_outputs_max=1, n_threads=config.n_threads, mtp=True)
    return EngineSpecs(method, draft_max, rollback.n_rs_seq,
                       isinstance(rollback, CompactRollback), target, draft)
