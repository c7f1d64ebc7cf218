"""How likely a looked-up continuation token is to be accepted, from counts and from outcomes.

A candidate token comes with evidence: where it was found (the request's own prompt and
output, or other requests' cached outputs: ``shared``), how long the matched context is
(``depth``), how many earlier occurrences of it went on (``support``) and how many of those
went on with this token (``agree``). The first guess is a count estimate shrunk towards a
prior that grows with the depth (a 16-token match continued once is a copy; a 1-token match
is a coin toss). Verification then says how such guesses really went: every verified draft
token is one trial in its evidence cell, so the confidence the draft-length decision uses is
calibrated on this model and this traffic, and a kind of match that keeps failing (CSV values
after a repeated key) stops being drafted. The source is part of the cell because the two
fail differently: a cached output is the measured case of a confident wrong guess (a repeat
whose output left it), and its failures must not teach the request's own structure to stop
drafting, nor its own successes vouch for the cache.

A cached token can also be *fragile*: the target chose it over its runner-up by less than
:data:`FRAGILE_MARGIN` (``OutputCache`` keeps where, and how close). A batched verify is not
bit-identical to the decode that wrote the earlier output, so at such a near-tie a repeat of
the same request can choose the other token and write on from there: on Gemma 270M Q4_K_M,
over the five bench workloads, the partings of a repeat from its first output (and of
speculative from plain greedy) fell on tokens whose margin was below 0.26 (0.001-0.256),
all but one of 15 in a later count (0.58), while 1-2 % of tokens are that close. How close
matters: at a token below :data:`NEAR_TIE_MARGIN` four repeats in ten parted, between it
and :data:`FRAGILE_MARGIN` one in ten. Such a token is a cell of its own per
:func:`fragility`, guessed at its :data:`FRAGILE_PRIOR` share of the count estimate and then
calibrated like any other, so a draft of the cached answer is costed as what it is: likely
to part there, with every token after it conditional on that.
"""

from __future__ import annotations

from worker.engine.proposers.token_index import Calibration

#: Prior acceptance of a continuation by matched depth bucket (1, 2, 3-4, 5-8, 9-16, 17-32,
#: 33+ tokens): an opinion, corrected per cell by :class:`AcceptanceStats`.
DEPTH_PRIOR = (0.3, 0.45, 0.6, 0.75, 0.9, 0.95, 0.98)
#: Pseudo-occurrences the depth prior counts for in the count estimate.
PRIOR_OCCURRENCES = 1.0
#: Pseudo-trials the count estimate counts for against measured outcomes in its cell.
PRIOR_TRIALS = 4.0
#: A cell's trials are halved beyond this, so it follows a change of traffic.
MAX_TRIALS = 256.0
#: A committed token whose logit led the best other one by less than this is fragile (the
#: partings measured fell at margins of 0.001-0.256, one of 15 at 0.58; 1-2 % of Gemma's tokens
#: are below 0.3).
FRAGILE_MARGIN = 0.3
#: A fragile token closer than this is a near-tie. Gemma 270M Q4_K_M, the five
#: ``spec_vs_plain`` workloads each written and then repeated, six rounds: of the first
#: output's tokens below 0.1 the repeat reached, it kept 14 of 24; of those between 0.1 and
#: 0.3, 37 of 41 (and one parting of the 15 fell above 0.3, at 0.58).
NEAR_TIE_MARGIN = 0.1
#: A token's first guess, as a share of its count estimate, by :func:`fragility` (firm,
#: fragile, a near-tie): what those repeats kept.
FRAGILE_PRIOR = (1.0, 0.9, 0.6)
#: The :func:`fragility` of a near-tie.
NEAR_TIE = 2

#: An evidence cell, numbered: (source, depth bucket, support bucket, agreement, fragility).
Cell = int


def fragility(margin: float) -> int:
    """How likely a repeat is to part at a token the target chose by ``margin``: 0 firm, 1
    fragile (below :data:`FRAGILE_MARGIN`), 2 a near-tie (below :data:`NEAR_TIE_MARGIN`)."""
    return NEAR_TIE if margin < NEAR_TIE_MARGIN else 1 if margin < FRAGILE_MARGIN else 0


class AcceptanceStats(Calibration):
    """Measured acceptance per evidence cell; one per engine, shared across generations.

    A candidate's cell buckets its evidence: the source, the matched depth (1, 2, 3-4, 5-8,
    9-16, 17-32, 33+ tokens), the support (1, 2-3, 4-7, 8+ occurrences), the agreeing share
    (all, 3/4+, 1/2+, less) and its :func:`fragility`. Its first guess is the count estimate
    ``(agree + k q) / (support + k)``, the share of occurrences that went on this way shrunk
    towards the depth prior ``q`` by ``k`` = :data:`PRIOR_OCCURRENCES` (times the
    :data:`FRAGILE_PRIOR` of its fragility); its confidence is ``(hits + m guess) / (trials +
    m)`` with ``m`` = :data:`PRIOR_TRIALS` pseudo-trials, and a cell's counts are halved past
    :data:`MAX_TRIALS`.

    The arithmetic is native code (``_lookup.c``'s ``Calibration``): the suffix drafter's walk
    asks it for every token it drafts. ``confidence(depth, support, agree, shared, fragile)``
    returns the probability and the cell; ``record(cell, accepted)`` counts one verified
    draft token of the cell (accepted, or the first rejected)."""

    def __init__(self) -> None:
        super().__init__(DEPTH_PRIOR, PRIOR_OCCURRENCES, PRIOR_TRIALS, MAX_TRIALS,
                         FRAGILE_PRIOR)


#: How much of its record a request keeps per verify (about the last ten verifies count).
RECORD_DECAY = 0.9
#: Pseudo-tokens of "as promised" that a request's record starts from and returns to.
RECORD_PRIOR = 2.0


class RequestRecord:
    """How one request's drafts did against what their confidences promised, lately.

    The cells calibrate over all traffic; a request can still sit where they are wrong. A
    repeat of a request on a quantized model is the measured case: its greedy output leaves
    the cached one within a few tokens (a batched verify is not bit-identical to a lone
    decode), the cache keeps matching it 64 tokens deep with 0.99, and each such draft is
    rejected at once (CSV rewritten as JSON, repeated: acceptance 0.31, 0.82x plain). So
    every confidence of its drafts is scaled by ``accepted / promised`` over its recent
    verifies (a draft promises the sum of its running confidence products, the accepted
    tokens it expects), at most 1 (a request never drafts beyond its cells). Scaling each
    token compounds along a draft, which is the caution wanted: the failures of such a
    request are spread over a draft's positions, and scaling only the first one left it
    drafting at a loss. The record decays towards "as promised" at every verify, drafted
    or not, so a request that stopped drafting gets its confidences back within a few
    dozen tokens.
    """

    def __init__(self) -> None:
        self._accepted = 0.0
        self._promised = 0.0

    def scale(self) -> float:
        return min(1.0, (self._accepted + RECORD_PRIOR) / (self._promised + RECORD_PRIOR))

    def record(self, promised: float, accepted: int) -> None:
        """One verify: the accepted tokens its draft promised (0 without one) and got."""
        self._accepted = RECORD_DECAY * self._accepted + accepted
        self._promised = RECORD_DECAY * self._promised + promised
