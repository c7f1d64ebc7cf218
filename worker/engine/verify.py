"""The verify step: ONE target decode of every slot's ``[last, d1..dn]`` (and of the prompt
chunks being prefilled), that keeps what the target agrees with.

Every verify row gets logits. Row ``i`` of a slot holds the target's distribution after
``[.., last, d1..di]``, and the slot's sampler decides how many drafts it keeps (greedy: while
its argmax equals ``d(i+1)``; sampled: rejection sampling, ``worker/engine/sampling.py``); the
first rejected row (or row ``n`` after a full accept) gives the next token for free (the
bonus). Order matters once the decode is done (notes, "several sequences"): every slot's
outcome is read and its proposer told while the verify's output rows are still there, the
prompt chunks are handed on (MTP feeds their hidden rows), then every slot's tail is rolled
back, and the deep rejections are replayed last (a replay is a decode and replaces the
outputs).

Where the engine buckets its steps (:mod:`worker.engine.drafting.buckets`, on a GPU), a step
with drafts is padded to a row count the device can replay: each verify's pad rows follow its
own rows in its own sequence, are never accepted, and leave with its rejected tail.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from time import perf_counter

from worker.engine.core.constraint import SlotConstraint
from worker.engine.core.draft import Draft, VerifyOutcome
from worker.engine.core.sampler import Sampler
from worker.engine.drafting.buckets import NO_BUCKETS, BucketPolicy
from worker.engine.logprobs import LogprobReporter
from worker.engine.overlap import SERIAL, HostWork, Overlap, no_work
from worker.engine.proposers.base import Proposer
from worker.engine.rollback import Rollback
from worker.llm import Batch, Context


@dataclass(frozen=True)
class VerifyJob:
    """One slot's verify: ``draft`` after ``last`` at ``pos0`` of sequence ``seq``
    (``history`` ends with ``last``), its rows masked by ``constraint``."""

    seq: int
    last: int
    draft: Draft
    pos0: int
    sampler: Sampler
    proposer: Proposer
    history: list[int]
    logprobs: LogprobReporter
    constraint: SlotConstraint


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt ``tokens`` of sequence ``seq`` at ``pos0..``, decoded without logits."""

    seq: int
    tokens: list[int]
    pos0: int


@dataclass(frozen=True)
class StepTimes:
    """Seconds of the target's work (decode, rollback), of its decode alone, and of the
    proposers' catch-up; and the pad rows each verify carried (``padded[i]``: job i's)."""

    target: float
    decode: float
    observe: float
    padded: list[int]


class Verifier:
    """Owns the target's batch; one instance per engine. ``buckets`` pads its steps (the
    no-op policy: none)."""

    def __init__(self, target: Context, rollback: Rollback, capacity: int,
                 buckets: BucketPolicy = NO_BUCKETS, overlap: Overlap = SERIAL) -> None:
        self.target = target
        self.rollback = rollback
        self.batch = Batch(capacity)
        self.buckets = buckets
        self.overlap = overlap

    def step(self, chunks: list[PrefillChunk], jobs: list[VerifyJob],
             prefilled: Callable[[PrefillChunk, int], None],
             during: HostWork = no_work) -> tuple[list[VerifyOutcome], StepTimes]:
        """Decode ``chunks`` and verify ``jobs`` in one batch, tell the proposers, roll back.

        ``prefilled(chunk, row0)`` is called for every chunk while its hidden rows (batch
        entries ``row0..``) are still in the target's outputs. ``during`` runs while the
        device decodes where that overlaps (:mod:`~worker.engine.overlap`), else after it.
        Raises :class:`RollbackError` when llama.cpp refuses a rollback: decoding on from an
        unrolled state would be silently wrong.
        """
        t0 = perf_counter()
        batch = self.batch.clear()
        pads = self.buckets.pads([1 + len(job.draft.tokens) for job in jobs],
                                 [job.pos0 for job in jobs], bool(chunks))
        for job, pad in zip(jobs, pads, strict=True):
            self.rollback.prepare(self.target, job.seq, len(job.draft.tokens) + pad)
        # In ascending sequence order: llama.cpp's recurrent memory splits a batch whose
        # sequence ids do not run up by one into several ubatches, and a snapshot rollback
        # after such a decode restored another state (tiny hybrid, 3 slots: rows of seqs
        # 2, 0, 1 in that order, then a rollback of seq 2 by 6: its next row parted from
        # plain at a 17-nat margin; the same operations in seq order did not).
        chunk_rows = [0] * len(chunks)  # each chunk's and each verify's first row
        rows = [0] * len(jobs)
        for _, verify, i in sorted([(c.seq, False, i) for i, c in enumerate(chunks)]
                                   + [(j.seq, True, i) for i, j in enumerate(jobs)]):
            if verify:
                job = jobs[i]
                rows[i] = batch.add(_decoded(job, job.draft.tokens, pads[i]), job.pos0, True,
                                    seq=job.seq)
            else:
                chunk = chunks[i]
                chunk_rows[i] = batch.add(chunk.tokens, chunk.pos0, False, seq=chunk.seq)
        td = perf_counter()
        self.target.decode(batch)
        # Synchronised, else a GPU's decode time is only its kernel launches.
        host = self.overlap.wait(self.target, during)
        decode = perf_counter() - td - host
        alone = len(jobs) == 1 and not chunks
        outcomes = [self._accept(job, row0, alone) for job, row0 in zip(jobs, rows, strict=True)]
        t1 = perf_counter()
        for job, outcome in zip(jobs, outcomes, strict=True):
            job.proposer.observe(outcome)
        for chunk, row0 in zip(chunks, chunk_rows, strict=True):
            prefilled(chunk, row0)
        t2 = perf_counter()
        for job, outcome, pad in zip(jobs, outcomes, pads, strict=True):
            if outcome.n_accepted < len(outcome.draft) + pad:
                self.rollback.rewind(self.target, job.seq, _decoded(job, outcome.draft, pad),
                                     job.pos0, outcome.n_accepted)
        self.rollback.settle(self.target)
        t3 = perf_counter()
        return outcomes, StepTimes(target=(t1 - t0 - host) + (t3 - t2), decode=decode,
                                   observe=t2 - t1,
                                   padded=pads)

    def _accept(self, job: VerifyJob, row0: int, alone: bool) -> VerifyOutcome:
        n_accepted, token = job.sampler.verify(self.target, row0, job.pos0, job.history,
                                               job.draft, job.constraint)
        drafts = job.draft.tokens
        logprobs = job.logprobs.report(self.target, row0, [*drafts[:n_accepted], token])
        return VerifyOutcome(job.pos0, job.last, drafts, n_accepted, token, row0, logprobs, alone)

    def close(self) -> None:
        self.batch.close()


def _decoded(job: VerifyJob, draft: Sequence[int], pad: int) -> list[int]:
    """What a verify decodes for ``job``: its last token, ``draft``, and ``pad`` pad rows (its
    last token again: any token would do, none of them is ever read or kept)."""
    return [job.last, *draft, *[job.last] * pad]
