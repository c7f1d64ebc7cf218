"""What an engine is built for, and the llama.cpp model and context specs that follow from it.

One definition serves two readers: :class:`~worker.engine.engine.SpeculativeEngine` creates its
contexts from these specs, and the fitter measures contexts built from the very same specs
before the engine exists. A batch width changed here changes both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.protocol import CheckpointMode, SpecMethod, SpecSettings
from worker.llm import ContextSpec, ModelSpec

#: Physical batch of the target: prompts are prefilled in slices of this many tokens.
TARGET_UBATCH = 512
#: Draft-context batch width: compute buffers scale with ubatch x vocabulary (seed 000 cut
#: it from 256 to 32); the prompt catch-up simply takes more, smaller decodes.
DRAFT_BATCH = 32


@dataclass(frozen=True)
class EngineConfig:
    """What the engine is built for. ``spec`` is its capacity: the draft width N the
    contexts are sized for, the rollback depth D (None = N) and the drafting method."""

    model_path: str
    n_ctx: int = 4096
    n_threads: int = 2
    n_gpu_layers: int = 0
    spec: SpecSettings = field(default_factory=SpecSettings)
    checkpoint: CheckpointMode = CheckpointMode.DEVICE
    fail_device_checkpoint: bool = False
    #: Time the target's verify decodes at load (1..N+1 rows) and verify only draft lengths
    #: that pay for themselves (see verify_shape.py). Costs a few seconds at start on CPU.
    calibrate_verify: bool = False


def needs_mtp_weights(method: SpecMethod) -> bool:
    """Load the NextN tensors only when MTP may draft (``auto`` decides after loading)."""
    return method in (SpecMethod.MTP, SpecMethod.AUTO)


def model_spec(config: EngineConfig, no_alloc: bool = False) -> ModelSpec:
    """How the engine loads its model (``no_alloc``: the fitter's metadata-only twin)."""
    return ModelSpec(config.model_path, load_mtp=needs_mtp_weights(config.spec.method),
                     n_gpu_layers=config.n_gpu_layers, no_alloc=no_alloc)


def target_spec(config: EngineConfig, n_rs_seq: int, draft_max: int,
                slots: int = 1) -> ContextSpec:
    """The target context: a verify needs ``draft_max + 1`` output rows at most, so the
    output buffer is capped there instead of at the batch width (notes: 514 -> 22 MiB)."""
    return ContextSpec(n_ctx=config.n_ctx, n_batch=config.n_ctx, n_ubatch=TARGET_UBATCH,
                       n_seq_max=slots, n_rs_seq=n_rs_seq, n_outputs_max=draft_max + 1,
                       n_threads=config.n_threads, swa_full=False)


def draft_spec(config: EngineConfig) -> ContextSpec:
    """The MTP draft context: same length as the target, narrow batches, one output row."""
    return ContextSpec(n_ctx=config.n_ctx, n_batch=DRAFT_BATCH, n_ubatch=DRAFT_BATCH,
                       n_outputs_max=1, n_threads=config.n_threads, mtp=True)
