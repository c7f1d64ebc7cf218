"""MTP plus suffix lookup (llama-server's ``draft-mtp,ngram-mod``): the longer confident draft.

The lookup is nearly free and, where the text repeats, drafts further and surer than the
head; the head drafts where nothing repeats. Each step asks the lookup first and runs the
head only when the lookup's draft does not already fill the width, then verifies the longer
of the two (the lookup's draft is already cut to what its confidences pay for; the head's by
``p_min``); a repeat's draft that holds a near-tie's shape (``repeat_shape.py``) is verified
as it is, however short. Both are told every outcome: the head must catch up on every
accepted token whoever drafted it, and the lookup learns costs and calibration from its own
tokens only.
"""

from __future__ import annotations

from collections.abc import Sequence

from worker.engine.core.draft import Draft, VerifyOutcome
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
        lookup = self._suffix.propose(history, width, p_min)
        if len(lookup.tokens) >= width or self._suffix.shaped:
            return lookup
        head = self._mtp.propose(history, width, p_min)
        self._suffix.stamp()  # the head's drafting is not part of the verify's cost
        return head if len(head.tokens) > len(lookup.tokens) else lookup

    def observe(self, outcome: VerifyOutcome) -> None:
        self._suffix.observe(outcome)  # first: it times the verify up to now
        self._mtp.observe(outcome)
