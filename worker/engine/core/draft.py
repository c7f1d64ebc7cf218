"""What a drafter proposes and what the verify established: the values the engine, the
drafters, the samplers, the grammar and the draft planner exchange, kept in a leaf module
below all of them (none of them imports another to know a draft's shape)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.protocol import TokenLogprob
    from worker.engine.core.distribution import Distribution


@dataclass(frozen=True)
class Draft:
    """Proposed continuation of ``last_token``.

    A draft shorter than the width asked for was cut short (p-min, no n-gram continuation, a
    failed draft decode); the width policy reads that from its length alone. ``dists`` are
    the distributions the tokens were sampled from (the MTP head under sampling), for
    rejection sampling; None: every token is a point mass (lookup drafts, greedy drafts).
    ``confidences`` are the drafter's own calibrated chances that each token is accepted
    given that those before it were (the suffix drafter's); the row budget prefers them to the
    slot's record per position. None: the drafter has no such estimate.
    """

    tokens: list[int]
    dists: list[Distribution] | None = None
    confidences: list[float] | None = None

    def cut(self, width: int) -> Draft:
        """The first ``width`` tokens (a width policy or the row budget shortened it)."""
        if width >= len(self.tokens):
            return self
        return Draft(self.tokens[:width], None if self.dists is None else self.dists[:width],
                     None if self.confidences is None else self.confidences[:width])


@dataclass(frozen=True)
class VerifyOutcome:
    """What one verify decode of ``[last_token, *draft]`` at ``pos0`` established.

    ``n_accepted`` drafts were accepted (greedy: they matched the target's argmax); ``bonus``
    is the target's token at the first unverified row. ``logprobs`` describe the accepted
    drafts and the bonus, in order, when the request asked for them. The verify's rows start
    at entry ``row0`` of the target's batch (several slots share one decode): entry
    ``row0 + i`` holds the logits and hidden state of ``[last_token, *draft][i]``. ``alone``:
    the decode held only these rows (no other slot's, no prompt chunk), so its duration is
    what this verify's width costs (only the verifier knows: False unless it says so).
    """

    pos0: int
    last_token: int
    draft: list[int]
    n_accepted: int
    bonus: int
    row0: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    alone: bool = False

    @property
    def accepted(self) -> list[int]:
        return self.draft[: self.n_accepted]
