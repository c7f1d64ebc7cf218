"""Row counts a device can replay: a step that verifies drafts decodes one of a few widths.

ggml-cuda keeps one CUDA graph per graph key (the address of the cgraph's first node, the
same whatever shape llama.cpp builds), compares each node's shape, strides, sources and data
with the last decode's, and replays the captured graph only when nothing changed; a change
resets it, and it is captured again once two decodes in a row are alike (llama.cpp 0.3.36,
ggml-cuda.cu: ``ggml_cuda_graph_update_required``, ``ggml_backend_cuda_graph_compute``).
Above it llama.cpp reuses its built graph only for a compatible ubatch
(``llm_graph_params::allow_reuse`` and each input's ``can_reuse``, src/llama-graph.*): the
same token count, output count, sequences per ubatch (``n_seqs``, ``n_seqs_unq``), KQ-mask
size (``n_kv``, which moves in steps of 256 cells) and, where a sequence is sampled on the
device, the same sequence and output flag on every row. A verify decodes its slot's last
token and its draft, so its row count changes nearly every step, and the plain step after it
changes shape again: on an H200 (Gemma 3 270M) a one-row decode ran 1.16 ms replayed and
2.26 ms not, a constant 9-row decode 2.95 ms, widths varying around it 3.65-4.06 ms.

So where the layers run on a GPU (``EnginePlan.verify_buckets``; ``--verify-buckets
on|off|auto``), a step that verifies drafts is padded to :func:`bucket` of its rows
(:meth:`RowBuckets.pads`), and the planner prices a plan of ``r`` rows at its bucket's
(:meth:`RowBuckets.priced`): five rows cost what eight do, so a drafter that may draft seven
is not cut to four for nothing. Elsewhere the no-op policy (:data:`NO_BUCKETS`) pads nothing
and prices rows as they are: the loop asks a policy either way, never ``if buckets``.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Collection, Sequence
from typing import Protocol

from worker.engine.drafting.curve import CostCurve

#: The row counts a step with drafts decodes: every power of two to 16 (one slot's short
#: drafts), then half-power steps, so a bucket wastes at most a third of its rows. Coarser
#: buckets replay more often and pad more rows; each row costs the output layer (Gemma's
#: 262k-wide logits), which is why they are not all powers of two past 16.
ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


def bucket(rows: int, cap: int) -> int:
    """The rows a step of ``rows`` rows decodes: the smallest of :data:`ROW_BUCKETS` that
    holds them, at most ``cap`` (what the step may decode at all: its slots' rows), and never
    fewer than ``rows`` (past the widest bucket, or past ``cap``, the rows themselves; no rows:
    none)."""
    if rows <= 0:
        return 0
    i = bisect_left(ROW_BUCKETS, rows)
    wanted = ROW_BUCKETS[i] if i < len(ROW_BUCKETS) else rows
    return max(rows, min(wanted, cap))


class BucketPolicy(Protocol):
    """How a verify step's rows are padded and priced (:class:`RowBuckets`, or
    :data:`NO_BUCKETS`)."""

    def pads(self, rows: Sequence[int], pos0: Sequence[int], prefilling: bool) -> list[int]:
        """Rows to add after each verify of a step (``rows[i]`` rows of a sequence whose
        first row is at position ``pos0[i]``); ``prefilling``: the step also decodes a
        prompt chunk."""
        ...

    def priced(self, curve: CostCurve) -> CostCurve:
        """``curve`` as the planner prices plans with it."""
        ...


class NoBuckets:
    """Rows as they come: nothing padded, every width priced as itself."""

    def pads(self, rows: Sequence[int], pos0: Sequence[int], prefilling: bool) -> list[int]:
        return [0] * len(rows)

    def priced(self, curve: CostCurve) -> CostCurve:
        return curve


#: The policy of an engine that does not bucket (a CPU's: nothing is replayed there).
NO_BUCKETS = NoBuckets()


class RowBuckets:
    """Pad a step with drafts to its bucket; ``per_slot``: the most rows one sequence may
    have in a step (a verify of the widest draft), ``n_ctx``: a slot's context.

    What a pad is, and why (each point is what llama.cpp's reuse checks above ask for):

    - a row of a verified sequence, after its verify rows (the next positions, its last
      token again), *with an output*: the output count is part of the graph (the output
      rows' selection and the output layer's width) and ``allow_reuse`` compares it, so a
      pad without one left it changing with every draft;
    - in the step's own sequences, not a scratch one: a scratch sequence present on some
      steps changes ``n_seqs_unq``; where llama.cpp splits a batch into ubatches of
      equal-length sequences (a recurrent or hybrid model, a KV stream per sequence:
      ``split_equal``) a scratch sequence's rows were a ubatch of their own; a sequence
      sampled on the device has one sampling view per output row of it
      (``build_sampling``), and rows of a sequence without a sampler make llama.cpp copy
      the whole ubatch's logits to the host. Pads of the slot's own sequence are sampled
      with it (nothing copied), one slot's step is one sequence of the bucket's rows every
      time, and the target needs no extra sequence (nothing more for the fitter to count);
    - never seen by the slot: a row attends only to earlier positions of its sequence, so
      the verify rows' logits are the same with pads after them, and the pads are rolled
      back with the verify's rejected tail (a KV trim, or a recurrent snapshot restored: a
      sequence never exceeds ``per_slot`` rows, the snapshots the target was made with).

    Not padded: a step that also prefills (its chunk's rows have no outputs, and their count
    follows the prompt) and a step without drafts (its width is the busy slot count, which
    repeats step after step and replays as it is)."""

    def __init__(self, per_slot: int, n_ctx: int) -> None:
        if per_slot < 1 or n_ctx < 1:
            raise ValueError(f"row buckets need per_slot >= 1 and n_ctx >= 1, got {per_slot} "
                             f"and {n_ctx}")
        self.per_slot = per_slot
        self.n_ctx = n_ctx

    def pads(self, rows: Sequence[int], pos0: Sequence[int], prefilling: bool) -> list[int]:
        """Each verify's pad rows: the step's bucket (:func:`bucket`, at most ``per_slot``
        rows a sequence) less its rows, each pad to the sequence with the fewest rows that
        has room (the first on a tie), so the sequences' lengths end as even as they can
        (fewer ubatches where llama.cpp splits by equal lengths). A sequence's room is
        ``per_slot`` rows and the end of its context: near it, a step pads less."""
        out = [0] * len(rows)
        if prefilling or all(r <= 1 for r in rows):
            return out
        total = sum(rows)
        want = bucket(total, len(rows) * self.per_slot) - total
        room = [max(0, min(self.per_slot - r, self.n_ctx - p - r))
                for r, p in zip(rows, pos0, strict=True)]
        have = list(rows)
        for _ in range(want):
            open_ = [i for i in range(len(rows)) if out[i] < room[i]]
            if not open_:
                break
            i = min(open_, key=have.__getitem__)
            out[i] += 1
            have[i] += 1
        return out

    def priced(self, curve: CostCurve) -> CostCurve:
        return BucketPricedCurve(curve)


class BucketPricedCurve(CostCurve):
    """A cost curve that prices a plan of ``r`` rows at :func:`bucket` of ``r``: what the
    padded step decodes. The widths in ``steady`` (plain steps: a row per busy slot) are
    never padded and keep their own steady price. The table's widest width is the cap, as a
    step whose every slot is busy has it."""

    def __init__(self, curve: CostCurve) -> None:
        super().__init__(dict(curve.timed), dict(curve.steady))

    def table(self, max_rows: int, steady: Collection[int] = ()) -> list[float]:
        timed = super().table(max_rows)
        plain = super().table(max_rows, steady)
        return [plain[r] if r in steady else timed[bucket(r, max_rows)]
                for r in range(max_rows + 1)]
