"""What an engine is built for, and the llama.cpp model and context specs that follow from it.

One definition serves two readers: :class:`~worker.engine.engine.SpeculativeEngine` creates its
contexts from these specs, and the fitter measures contexts built from the very same specs
before the engine exists. A batch width changed here changes both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.protocol import CheckpointMode, SpecMethod, SpecSettings
from worker.engine.drafting.curve import CostCurve
from worker.engine.proposers.output_cache import DEFAULT_CACHE_BYTES
from worker.launch import (
    CAPACITY_FIELDS,
    DEFAULT_CHECKPOINTS,
    DETERMINISTIC_CPU_ONLY,
    EngineCapacity,
)
from worker.llm import ContextSpec, ModelSpec

#: Physical batch of the target: prompts are prefilled in slices of this many tokens.
TARGET_UBATCH = 512
#: Prompt tokens prefilled per engine step, over all slots still loading a prompt: a long
#: prompt is decoded in slices of this size mixed into the verify batches, so the other slots
#: keep streaming while it loads.
PREFILL_CHUNK = TARGET_UBATCH
#: Draft-context batch width: compute buffers scale with ubatch x vocabulary, so it is 32,
#: not 256 (docs/engine.md, "Proposers"); the prompt catch-up simply takes more, smaller
#: decodes.
DRAFT_BATCH = 32
#: Inputs one embedding decode may pool at most (its context's sequences): every sequence
#: costs the output buffer a row of the vocabulary's width even when unused. The embedding
#: context's tokens are a multiple of it: llama.cpp sizes the context's graphs for its
#: tokens spread evenly over its sequences, and a remainder aborts the process (mean pooling
#: then multiplies mismatched matrices).
EMBEDDING_SEQS = 64


@dataclass(frozen=True)
class EngineConfig:
    """What the engine is built for: its ``capacity`` (method, draft width N, rollback depth
    D), and the ``request_defaults`` a request that sends no settings runs with (the
    drafters' knobs: ``p_min``, ``adaptive``, ``draft_min``, n-gram lengths; its method, N and
    D are the capacity's, filled in by :meth:`SpeculativeEngine.admit`).
    ``slots`` sequences run at once, each with a context of ``n_ctx`` tokens."""

    model_path: str
    n_ctx: int = 4096
    slots: int = 1
    n_threads: int = 2
    n_gpu_layers: int = 0
    capacity: EngineCapacity = field(default_factory=EngineCapacity)
    request_defaults: SpecSettings = field(default_factory=SpecSettings)
    checkpoint: CheckpointMode = CheckpointMode.DEVICE
    fail_device_checkpoint: bool = False
    #: Time the target's verify decodes at load (1..N+1 rows) and verify only draft lengths
    #: that pay for themselves (drafting/shape.py). Costs a few seconds at start on CPU.
    calibrate_verify: bool = False
    #: With several slots, verify only the draft rows that raise the step's expected tokens
    #: per second (drafting/budget.py; the row costs are timed at load). Off: every draft as
    #: proposed (tests that schedule exact rejection depths).
    row_budget: bool = True
    #: Where row-cost curves are kept between starts (``drafting/cache.py``; None: timed at
    #: every load). A worker passes its cache directory; engines in tests time their own.
    cost_cache: str | None = None
    #: The row-cost curve to plan with instead of timing one (tests that must not depend on
    #: how fast the host runs: a drafting decision then follows from the curve alone).
    row_costs: CostCurve | None = None
    #: Greedy unconstrained verify rows reduced to their top two on the device instead of read
    #: whole by Python (``EnginePlan.device_verify``). None: where the layers run on a GPU (on
    #: a 2-core CPU llama.cpp's sampling graph made every verify row 0.5-0.7 ms dearer, and
    #: saved 0.05-0.12 ms of host work a row).
    device_verify: bool | None = None
    #: Steps that verify drafts padded to a row count the device replays the decode graph of
    #: (``EnginePlan.verify_buckets``, ``worker/engine/drafting/buckets.py``). None: where
    #: the layers run on a GPU (a CPU replays nothing, and every pad row costs it the
    #: output layer); refused with compact rollback.
    verify_buckets: bool | None = None
    #: Bound of the suffix drafter's cache of recent outputs (method suffix / mtp+suffix);
    #: host memory, counted by the fitter as ``lookup_cache``.
    lookup_cache_bytes: int = DEFAULT_CACHE_BYTES
    #: Reuse prompt prefixes across requests (``worker/engine/prefix_cache.py``): a finished
    #: slot keeps its sequence for the next request that shares its prefix.
    prefix_cache: bool = True
    #: Prefix checkpoints kept per slot where the state cannot be trimmed (sliding-window and
    #: recurrent models); host memory, counted by the fitter as ``prefix_checkpoints``.
    prefix_checkpoints: int = DEFAULT_CHECKPOINTS
    #: Greedy output that does not depend on batch width, slot count, draft length, thread
    #: count or which worker (same build, same CPU features) ran it: the target decodes
    #: through width-invariant CPU kernels only (docs/engine.md, "Deterministic mode").
    #: CPU backend only: a GPU build is refused (:data:`DETERMINISTIC_CPU_ONLY`).
    deterministic: bool = False
    #: A KV stream per sequence instead of one cache for all (``ContextSpec.kv_unified``):
    #: each slot's logits then never depend on what the other slots hold, so on models whose
    #: products are width-invariant (the F32 test models) multi-slot greedy output equals a
    #: lone slot's bit for bit; steps whose slots carry different row counts pay one weight
    #: pass per distinct count. Deterministic mode implies it.
    per_sequence_kv: bool = False
    #: Tokens of the embedding context beside the target (0: none), rounded up to a multiple
    #: of :data:`EMBEDDING_SEQS`: the longest input an embedding may have, and what one
    #: embedding decode pools at most (:func:`embedding_spec`, ``worker/engine/embedding.py``).
    #: Counted by the fitter as ``embeddings``.
    embedding_tokens: int = 0

    def __post_init__(self) -> None:
        if self.deterministic and self.n_gpu_layers != 0:
            raise ValueError(DETERMINISTIC_CPU_ONLY)
        if given := sorted(CAPACITY_FIELDS & self.request_defaults.model_fields_set):
            raise ValueError(f"request_defaults sets {', '.join(given)}: an engine's method, "
                             "draft width and rollback depth are its capacity "
                             "(EngineConfig.capacity)")
        if self.prefix_checkpoints < 0:
            raise ValueError(f"prefix_checkpoints must be >= 0, got {self.prefix_checkpoints}")


def needs_mtp_weights(method: SpecMethod) -> bool:
    """Load the NextN tensors only when MTP may draft (``auto`` decides after loading)."""
    return method in (SpecMethod.MTP, SpecMethod.MTP_SUFFIX, SpecMethod.AUTO)


def model_spec(config: EngineConfig, no_alloc: bool = False) -> ModelSpec:
    """How the engine loads its model (``no_alloc``: the fitter's metadata-only twin)."""
    return ModelSpec(config.model_path, load_mtp=needs_mtp_weights(config.capacity.method),
                     n_gpu_layers=config.n_gpu_layers, no_alloc=no_alloc,
                     repack=not config.deterministic)


def target_spec(config: EngineConfig, n_rs_seq: int, draft_max: int,
                device_verify: bool = False) -> ContextSpec:
    """The target context: ``slots`` sequences of ``n_ctx`` tokens each (a cache of
    ``slots x n_ctx`` cells; the engine keeps each sequence within ``n_ctx``). One step's
    batch holds every slot's verify rows (``draft_max + 1`` each, all with logits) plus at
    most one prefill chunk, so the output buffer is capped at the verify rows instead of the
    batch width (notes: 514 -> 22 MiB) and the batch at chunk + verify rows. Deterministic
    mode adds a row per slot for :meth:`~worker.llm.Batch.pad_even` (a slot prefills or
    verifies in a step, never both). ``device_verify``: every sequence is sampled on the
    device from creation (the fitter measures the buffers that takes), at most a verify's
    rows per sequence."""
    per_slot = draft_max + 1 + config.deterministic
    verify_rows = config.slots * per_slot
    return ContextSpec(n_ctx=config.n_ctx * config.slots, n_batch=PREFILL_CHUNK + verify_rows,
                       n_ubatch=TARGET_UBATCH, n_seq_max=config.slots, n_rs_seq=n_rs_seq,
                       n_outputs_max=verify_rows, n_threads=config.n_threads, swa_full=False,
                       kv_unified=unified_kv(config, n_rs_seq), deterministic=config.deterministic,
                       device_top2=device_verify,
                       n_outputs_max_per_seq=per_slot if device_verify else 0)


def unified_kv(config: EngineConfig, n_rs_seq: int = 0) -> bool:
    """One KV cache for every slot, unless the config asks for a stream per sequence (a
    deterministic context always has one: ``ContextSpec.deterministic`` decides that), or
    several slots roll a recurrent state back through ``n_rs_seq`` snapshots.

    llama.cpp's hybrid memory splits a unified cache's batch into equal ubatches out of
    sequence order (``split_equal(.., sequential=False, ..)``, for multiple-choice evals),
    and its recurrent snapshots assume sequence order: after a snapshot rollback, a verify of
    rows spread unevenly over the slots (1, 8 and 8 rows) came back from another state than
    the sequence's (the tiny hybrid, 3 slots, MTP: 6 of 60 requests' greedy output parted
    from plain's at a 16-27 nat margin; a context-level replay gave 4 wrong rows of 3,327
    with one cache, 0 with a stream per sequence). A stream per sequence splits in order."""
    return not config.per_sequence_kv and not (n_rs_seq > 0 and config.slots > 1)


def draft_batch(config: EngineConfig, draft_max: int) -> int:
    """Entries of one MTP draft decode: every slot's catch-up (``draft_max + 1``) plus its next
    drafted position, or a prompt slice of :data:`DRAFT_BATCH`."""
    return max(DRAFT_BATCH, config.slots * (draft_max + 2))


def draft_spec(config: EngineConfig, draft_max: int) -> ContextSpec:
    """The MTP draft context: as many sequences and tokens as the target, narrow ubatches, one
    output row per slot (every slot drafts its next token in the same decode)."""
    return ContextSpec(n_ctx=config.n_ctx * config.slots, n_batch=draft_batch(config, draft_max),
                       n_ubatch=DRAFT_BATCH, n_seq_max=config.slots, n_outputs_max=config.slots,
                       n_threads=config.n_threads, mtp=True, kv_unified=unified_kv(config))


def embedding_spec(config: EngineConfig) -> ContextSpec | None:
    """The embedding context (None: the engine serves no embeddings): ``embedding_tokens``
    (rounded up to a multiple of :data:`EMBEDDING_SEQS`) cells shared by up to
    :data:`EMBEDDING_SEQS` inputs, decoded in one ubatch (a sequence's rows must be pooled
    together, and a non-causal model attends over all of them at once)."""
    if config.embedding_tokens <= 0:
        return None
    tokens = -(-config.embedding_tokens // EMBEDDING_SEQS) * EMBEDDING_SEQS
    return ContextSpec(n_ctx=tokens, n_batch=tokens, n_ubatch=tokens, n_seq_max=EMBEDDING_SEQS,
                       n_threads=config.n_threads, embeddings=True, kv_unified=True)
