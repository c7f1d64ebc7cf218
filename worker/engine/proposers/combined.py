"""MTP plus suffix lookup (llama-server's ``draft-mtp,ngram-mod``): the longer confident draft.

The lookup is nearly free and, where the text repeats, drafts further and surer than the
head; the head drafts where nothing repeats. Each step asks the lookup first and runs the
head only when the lookup's draft does not already fill the width, then verifies the longer
of the two (the lookup's draft is already cut to what its confidences pay for; the head's by
``p_min``); a repeat's draft that holds a near-tie's shape (``repeat_shape.py``) is verified
as it is, however short. Both are told every outcome: the head must catch up on every
accepted token whoever drafted it, and the lookup learns costs and calibration from its own
tokens only. Staged (:class:`~worker.engine.proposers.head.Staged`), the head's part of every
such slot of a step runs in the engine's one batched head draft.
"""

from __future__ import annotations

from collections.abc import Sequence

from worker.engine.core.draft import Draft, VerifyOutcome
from worker.engine.proposers.head import DraftRequest
from worker.engine.proposers.mtp import MtpProposer
from worker.engine.proposers.suffix import SuffixProposer


class MtpSuffixProposer:
    """Runs both drafters; the MTP one is the engine's resident instance."""

    def __init__(self, mtp: MtpProposer, suffix: SuffixProposer) -> None:
        self._mtp = mtp
        self._suffix = suffix

    def start(self, prompt: Sequence[int]) -> None:
        self._mtp.start(prompt)
        self._suffix.start(prompt)

    def propose(self, history: Sequence[int], width: int, p_min: float) -> Draft:
        lookup, needs_head = self.stage(history, width, p_min)
        if not needs_head:
            return lookup
        return self.choose(lookup, self._mtp.propose(history, width, p_min))

    def stage(self, history: Sequence[int], width: int, p_min: float) -> tuple[Draft, bool]:
        """The lookup's draft; the head is asked too unless that fills the width or holds a
        near-tie's shape. (The head's catch-up then waits for the next step it drafts in:
        its backlog is fed by that draft's first decode.)"""
        lookup = self._suffix.propose(history, width, p_min)
        return lookup, not (len(lookup.tokens) >= width or self._suffix.shaped)

    def request(self, history: Sequence[int], width: int, p_min: float) -> DraftRequest:
        return self._mtp.request(history, width, p_min)

    def choose(self, staged: Draft, head: Draft) -> Draft:
        self._suffix.stamp()  # the head's drafting is not part of the verify's cost
        return head if len(head.tokens) > len(staged.tokens) else staged

    def observe(self, outcome: VerifyOutcome) -> None:
        self._suffix.observe(outcome)  # first: it times the verify up to now
        self._mtp.observe(outcome)
