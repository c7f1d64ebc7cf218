"""What an engine will be, decided once from its config and the model's facts.

Every choice that sizes an engine's contexts and memory is made here, by one pure function:
the concrete drafting method (``auto`` resolved, MTP refused on a head-less model), the draft
width N (the method's default where the capacity leaves it unset, ``0`` when the engine does
not speculate), the rollback policy and the recurrent
snapshots ``n_rs_seq`` it needs, and whether every slot needs checkpoint storage. The engine
builds itself from the plan, and the fitter measures contexts built from the very same plan
before any engine exists, so the two can never decide differently (and the fitter allocates
nothing to find out).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from shared.protocol import MAX_DRAFT, CheckpointMode, SpecMethod, SpecSettings, WorkerCapacity
from worker.engine.config import EngineConfig
from worker.engine.drafting.buckets import NO_BUCKETS, BucketPolicy, RowBuckets
from worker.engine.proposers.factory import uses_mtp, uses_suffix
from worker.engine.proposers.mtp import MtpUnavailableError
from worker.engine.rollback import CompactRollback, KvTrimRollback, Rollback, SnapshotRollback
from worker.launch import check_rollback_depth
from worker.llm import Model


@dataclass(frozen=True)
class ModelFacts:
    """What the plan needs to know about a model (read from a loaded, or no-alloc, one)."""

    path: str
    #: Recurrent or hybrid: rejected drafts need snapshots (or a checkpoint) to roll back.
    recurrent: bool
    #: The GGUF carries an MTP (NextN) head.
    mtp_head: bool
    #: Its layers run on a GPU (``Model.offloaded``).
    offloaded: bool = False

    @classmethod
    def of(cls, model: Model) -> ModelFacts:
        return cls(model.spec.path, model.is_recurrent, model.has_mtp_head, model.offloaded)


class RollbackKind(Enum):
    """Which rollback policy the target gets (:meth:`EnginePlan.rollback_policy`)."""

    #: Pure attention: rejected positions are trimmed from the KV cache.
    KV_TRIM = "kv_trim"
    #: Recurrent, one snapshot per draft position (D unset, or D >= N).
    SNAPSHOTS = "snapshots"
    #: Recurrent, D < N snapshots plus one checkpoint per slot, restored and replayed.
    COMPACT = "compact"


@dataclass(frozen=True)
class EnginePlan:
    """The decisions an engine is built from (see :func:`plan_engine`)."""

    #: The concrete method the engine loads (never ``auto``).
    method: SpecMethod
    #: Draft width N the contexts are sized for; 0 when the method does not draft.
    draft_max: int
    rollback: RollbackKind
    #: Recurrent snapshots per sequence the target is created with (D, or N for D = N).
    n_rs_seq: int
    #: Where checkpoints start out (the configured mode), or None when the engine never
    #: checkpoints (pure attention, or D = N).
    checkpoint: CheckpointMode | None
    slots: int
    #: Greedy unconstrained slots verify on the device (``Context.sample_on_device``): every
    #: sequence of the target gets a top-2 chain at creation, and such a verify row comes
    #: back as two ids and two logits instead of a vocabulary-wide row (docs/engine.md,
    #: "Verify on the device").
    device_verify: bool = False
    #: Steps that verify drafts are padded to a row count a GPU replays the graph of, and
    #: plans are priced at it (docs/engine.md, "Replayable shapes"; :meth:`buckets`).
    verify_buckets: bool = False
    #: The serving loop's host work runs while the device decodes each step (its layers run
    #: on a GPU: llama.cpp's decode is queued there; :mod:`~worker.engine.overlap`).
    overlap: bool = False

    @property
    def checkpoints(self) -> bool:
        """Every slot needs checkpoint storage (compact rollback)."""
        return self.checkpoint is not None

    @property
    def mtp(self) -> bool:
        """The engine has an MTP draft context."""
        return uses_mtp(self.method)

    @property
    def suffix(self) -> bool:
        """The engine has the suffix drafters' row costs and output cache."""
        return uses_suffix(self.method)

    @property
    def rollback_depth(self) -> int | None:
        """The snapshots a recurrent target keeps (what a request's ``rollback_depth`` must
        match); None for a pure-attention model, which has nothing to roll back."""
        return None if self.rollback is RollbackKind.KV_TRIM else self.n_rs_seq

    def rollback_policy(self, fail_device_checkpoint: bool = False) -> Rollback:
        """The rollback policy of this plan's target context (``slots`` sequences, drafts of
        up to ``draft_max``); ``fail_device_checkpoint`` is the fault-injection switch."""
        if self.rollback is RollbackKind.KV_TRIM:
            return KvTrimRollback()
        if self.checkpoint is None:  # snapshots only: D = N
            return SnapshotRollback(self.n_rs_seq)
        return CompactRollback(self.n_rs_seq, self.draft_max, self.checkpoint,
                               fail_device_checkpoint, self.slots)

    def buckets(self, n_ctx: int) -> BucketPolicy:
        """How this plan's verify steps are padded and priced, for slots of ``n_ctx`` tokens:
        to :data:`~worker.engine.drafting.buckets.ROW_BUCKETS`, a sequence at most a verify of
        the widest draft (the rows its device sampler and its rollback snapshots are sized
        for), or not at all."""
        return RowBuckets(self.draft_max + 1, n_ctx) if self.verify_buckets else NO_BUCKETS

    def capacity(self) -> WorkerCapacity:
        """What a worker loaded from this plan can serve (requests may only narrow it)."""
        return WorkerCapacity(method=self.method, draft_max=self.draft_max,
                              rollback_depth=self.rollback_depth)


def resolve_method(method: SpecMethod, model: ModelFacts) -> SpecMethod:
    """The concrete method an engine is built for: ``auto`` is suffix drafting, with the MTP
    head beside it when the model has one (docs/engine.md, "Choosing a drafter": suffix only
    drafts what its measured confidences and row costs pay for, so it is the one drafter
    that does not lose to plain decoding where nothing repeats); MTP asked of a head-less
    model is an error, never a substitute."""
    if method is SpecMethod.AUTO:
        return SpecMethod.MTP_SUFFIX if model.mtp_head else SpecMethod.SUFFIX
    if uses_mtp(method) and not model.mtp_head:
        raise MtpUnavailableError(
            f"{model.path} has no MTP (NextN) head (nextn_predict_layers = 0): "
            "use spec method 'ngram' or 'auto'")
    return method


#: The draft width of an engine loaded without one, for every method but suffix drafting
#: (the request protocol's default: n-gram and MTP draft every position they are given).
DEFAULT_DRAFT_MAX: int = SpecSettings.model_fields["draft_max"].default
#: Suffix drafting's width on one slot, where a rejected draft is trimmed from the KV cache: a
#: fully accepted draft verifies 128 rows, whole tiles of the CPU's quantized products. Past
#: 64 rows a verify still gets cheaper a row (Gemma 270M Q4_K_M, AVX-512, 2 threads, fastest
#: of 15, as a share of one row at the same depth: 450 deep, 64 rows 0.305, 128 rows 0.266;
#: 250 deep, 0.280 and 0.259), so a repeat verified in two steps instead of four runs faster
#: (docs/benchmarks.md, "Width 127").
SUFFIX_DRAFT_MAX = 127
#: Its width on one slot of a recurrent or hybrid model, whose rollback keeps a recurrent
#: state a draft position (or a checkpoint per slot): memory the fitter reserves up front.
SUFFIX_RECURRENT_DRAFT_MAX = 63
#: Its width per slot when slots share a step (the step's rows are shared).
SUFFIX_SHARED_DRAFT_MAX = 32
#: Verify rows one step of a several-slot suffix engine is sized for, over all its slots:
#: what eight slots of the default width verify (no slot count above one allocates more output
#: rows than eight such slots did: 72 MiB of Gemma logits).
SUFFIX_STEP_ROWS = 8 * (DEFAULT_DRAFT_MAX + 1)


def default_draft_max(method: SpecMethod, slots: int, recurrent: bool = False) -> int:
    """N for an engine loaded without one (``recurrent``: the model rolls back by snapshots).

    Suffix drafting only verifies what its calibrated confidences and measured row costs pay
    for, so a wide ceiling costs nothing where nothing repeats, and where a text repeats at
    length the ceiling is the limit: on Gemma 270M Q4_K_M (CPU, 2 threads, 445 tokens deep)
    a fully accepted verify of 8 rows buys 2.4x a plain step's tokens per second, 32 rows
    3.2x, 64 rows 3.7x (ngram-mod's reach: a repeat at width 32 ran 0.86x its rate), and 128
    rows cost 13 % less a row than 64. So one slot drafts up to 127 (the same engine and row
    costs, interleaved, 4 rounds, against 63: warm repeats 1.05-1.13x on all five
    ``spec_vs_plain`` workloads, cold 0.99-1.07x), or 63 on a recurrent model. With several
    slots a step's rows are shared and the row budget verifies fewer drafts, so the width
    shrinks to keep every step within :data:`SUFFIX_STEP_ROWS` (2 slots 32, 4 slots 17, 8
    slots 8). The other drafters fill whatever width they get, so theirs stays the
    protocol's."""
    if method is not SpecMethod.SUFFIX:
        return DEFAULT_DRAFT_MAX
    if slots == 1:
        return SUFFIX_RECURRENT_DRAFT_MAX if recurrent else SUFFIX_DRAFT_MAX
    return min(SUFFIX_SHARED_DRAFT_MAX, SUFFIX_STEP_ROWS // slots - 1)


def plan_engine(config: EngineConfig, model: ModelFacts) -> EnginePlan:
    """The plan of an engine built from ``config`` on ``model``: its capacity, slots and
    checkpoint mode decide it (the request defaults size nothing)."""
    method = resolve_method(config.capacity.method, model)
    draft_max = 0
    if method is not SpecMethod.NONE:
        draft_max = config.capacity.draft_max or default_draft_max(method, config.slots,
                                                                   model.recurrent)
    depth = config.capacity.rollback_depth
    check_rollback_depth(depth, draft_max or MAX_DRAFT)
    if draft_max and config.request_defaults.draft_min > draft_max:
        raise ValueError(f"draft_min ({config.request_defaults.draft_min}) must not exceed "
                         f"draft_max ({draft_max})")
    if not model.recurrent:
        kind, n_rs_seq = RollbackKind.KV_TRIM, 0
    elif depth is None or depth >= draft_max:
        kind, n_rs_seq = RollbackKind.SNAPSHOTS, draft_max
    else:
        kind, n_rs_seq = RollbackKind.COMPACT, depth
    checkpoint = config.checkpoint if kind is RollbackKind.COMPACT else None
    wanted = model.offloaded if config.device_verify is None else config.device_verify
    return EnginePlan(method, draft_max, kind, n_rs_seq, checkpoint, config.slots,
                      device_verify=wanted and draft_max > 0,
                      verify_buckets=draft_max > 0 and bucketed(config, model, kind),
                      overlap=model.offloaded)


def bucketed(config: EngineConfig, model: ModelFacts, kind: RollbackKind) -> bool:
    """Whether verify steps are bucketed (``config.verify_buckets``; None: where the layers
    run on a GPU). Pad rows leave with a verify's rejected tail, so a full accept rolls
    back its pads: a trim, or a snapshot restore, but past D snapshots of compact rollback a
    checkpoint restore and a replay decode every step. So compact rollback never buckets, and
    asking for both is refused."""
    if kind is RollbackKind.COMPACT:
        if config.verify_buckets:
            raise ValueError(f"verify_buckets (--verify-buckets on) needs a rollback that "
                             f"keeps a snapshot a draft position: rollback_depth "
                             f"({config.capacity.rollback_depth}) < draft_max restores a "
                             f"checkpoint and replays to drop a step's pad rows")
        return False
    return model.offloaded if config.verify_buckets is None else config.verify_buckets
