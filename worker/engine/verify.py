"""The verify step: one target decode of ``[last, d1..dn]`` that keeps what the target agrees with.

Every row gets logits. Row ``i`` holds the target's own choice after ``[.., last, d1..di]``,
so the drafts are accepted while ``pick(row i) == d(i+1)``; the first row that disagrees (or
row ``n`` after a full accept) gives the next token for free (the bonus). The proposer is told
the outcome while the verify's hidden rows are still in the output buffers, then the target
is rolled back over the rejected tail.
"""

from __future__ import annotations

from time import perf_counter

from worker.engine.proposers.base import Proposer, VerifyOutcome
from worker.engine.rollback import Rollback
from worker.engine.sampling import TokenPicker
from worker.engine.telemetry import SpecCounters
from worker.llm import Batch, Context


class Verifier:
    """Owns the target's batch; one instance per engine."""

    def __init__(self, target: Context, rollback: Rollback, capacity: int) -> None:
        self.target = target
        self.rollback = rollback
        self.batch = Batch(capacity)

    def step(self, last: int, draft: list[int], pos0: int, pick: TokenPicker,
             proposer: Proposer, counters: SpecCounters) -> VerifyOutcome:
        """Verify ``draft`` after ``last`` (at ``pos0``), update the proposer, roll back.

        Target time (decode and rollback) is charged to ``decode_seconds``, the proposer's
        catch-up to ``draft_seconds``. Raises :class:`RollbackError` when llama.cpp refuses a
        rollback: decoding on from an unrolled state would be silently wrong.
        """
        t0 = perf_counter()
        self.rollback.prepare(self.target, len(draft))
        tokens = [last, *draft]
        self.target.decode(self.batch.set(tokens, pos0, True))
        n_accepted = 0
        token = pick(self.target, 0)
        while n_accepted < len(draft) and token == draft[n_accepted]:
            n_accepted += 1
            token = pick(self.target, n_accepted)
        outcome = VerifyOutcome(pos0, last, draft, n_accepted, token)
        t1 = perf_counter()
        proposer.observe(outcome)
        t2 = perf_counter()
        if n_accepted < len(draft):
            self.rollback.rewind(self.target, tokens, pos0, n_accepted)
        t3 = perf_counter()
        counters.decode_seconds += (t1 - t0) + (t3 - t2)
        counters.draft_seconds += t2 - t1
        counters.record_verify(len(draft), n_accepted)
        return outcome

    def close(self) -> None:
        self.batch.close()
