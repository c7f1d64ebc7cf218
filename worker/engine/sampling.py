"""Choosing tokens: the target distribution, and how verification keeps it exact.

One definition of "the target distribution" (:func:`target_distribution`, the stages in
:class:`~shared.protocol.SamplingParams`) serves plain sampling, the MTP head's drafts and
speculative verification, so speculation cannot change what a request samples from.

Verification is Leviathan et al.'s rejection sampling: a draft token ``x`` drawn with
probability ``q(x)`` is accepted with probability ``min(1, p(x)/q(x))``; on a rejection the
token is drawn from the normalised residual ``max(0, p - q)``; after a full accept the bonus
token is drawn from ``p``. A lookup drafter's token is a point mass (``q(x) = 1``), so it is
accepted with probability ``p(x)`` and its residual is ``p`` without ``x``.

Randomness is keyed, not streamed: the uniform that decides the token at position ``t`` is
a hash of (seed, t), so it does not depend on how many draws other positions, other slots or
other widths took. The acceptance region of ``x`` is placed on ``x``'s own interval of ``p``'s
cumulative distribution (token-id order) and the residual draw reuses the rest of the same
uniform; for a point-mass draft that makes the committed token exactly the one plain
sampling draws from the same uniform, whatever was drafted. So with plain, n-gram or suffix
drafting the same seed gives the same tokens as plain sampling, whatever the widths and the
batching; with MTP drafts (sampled from the head's distribution) the same seed gives the same
tokens for the same widths. Greedy is the temperature-0 case and stays token-exact.

Where the engine verifies on the device (docs/engine.md, "Verify on the device"), a request
that samples from the temperature and the top-k and min-p cuts draws there too
(:class:`DeviceRandomSampler`): each verify row draws plain sampling's token with the same
keyed uniform, in float32 on the device, so a point-mass draft is accepted exactly when it
equals that draw and no logits row reaches Python (docs/sampling.md, "Sampling on the
device").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from shared.protocol import SamplingParams, draw_seed
from worker.engine.core.constraint import SlotConstraint
from worker.engine.core.distribution import Distribution
from worker.engine.core.draft import Draft
from worker.engine.core.sampler import Sampler
from worker.engine.penalties import Penalties, adjustment
from worker.llm import Context
from worker.llm.device_sampling import Greedy

_MASK64 = (1 << 64) - 1
#: Log-probability floors (relative to the top token) tried in turn to find the ``top_p``
#: nucleus without sorting the whole vocabulary; -inf is the full sort, never needed in practice.
_NUCLEUS_FLOORS = (math.log(1e-3), math.log(1e-6), math.log(1e-10), -math.inf)


class Stream(IntEnum):
    """What a keyed uniform decides at a position; each has its own hash stream."""

    TARGET = 0
    DRAFT = 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a bijective 64-bit hash with full avalanche."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def keyed_uniform(seed: int, position: int, stream: Stream) -> float:
    """A uniform in [0, 1) that depends on (seed, position, stream) only."""
    return (_mix(_mix(_mix(seed) ^ position) ^ int(stream)) >> 11) * 2.0**-53


def accept_or_resample(p: Distribution, q: Distribution, x: int, u: float) -> tuple[bool, int]:
    """Leviathan's test of draft ``x`` (drawn from ``q``) against the target ``p``, decided by
    one uniform ``u``: accepted with probability ``min(1, p(x)/q(x))``, else the token is the
    residual's, drawn with what is left of ``u`` (uniform again given the rejection).

    The acceptance region starts where ``x``'s interval of ``p`` starts (wrapping past 1 when
    ``p(x)/q(x)`` runs over), so a point-mass draft is accepted exactly when plain sampling
    with ``u`` would have drawn ``x``, and its residual draw lands on plain sampling's token.
    """
    a = min(1.0, p.prob(x) / q.prob(x))
    if a >= 1.0:
        return True, x
    start = p.mass_below(x)
    end = start + a
    if end <= 1.0:
        if start <= u < end:
            return True, x
        rest = u if u < start else u - a
    else:
        if u >= start or u < end - 1.0:
            return True, x
        rest = u - (end - 1.0)
    return False, p.residual(q).pick(min(rest / (1.0 - a), np.nextafter(1.0, 0.0)))


def penalised_logits(logits: np.ndarray, params: SamplingParams, history: Sequence[int],
                     n_prompt: int) -> np.ndarray:
    """``logits`` (a view, left untouched) with ``logit_bias`` added, the repetition penalty
    over every token of ``history`` and the presence / frequency penalties over its generated
    part (``history[n_prompt:]``): :func:`adjustment`, applied in float32; the view itself when
    none is on. The bias is part of the target distribution, so drafts are verified against
    it and speculation stays lossless."""
    if not params.adjusted:
        return logits
    change = adjustment(params, history, n_prompt)
    z = logits.astype(np.float32, copy=True)
    v = z[change.ids] + change.bias
    z[change.ids] = np.where(v > 0, v / change.penalty, v * change.penalty) - change.minus
    return z


def target_distribution(logits: np.ndarray, params: SamplingParams, history: Sequence[int],
                        n_prompt: int) -> Distribution:
    """The distribution a request samples the next token from (temperature > 0): penalties,
    temperature, then the top-k, top-p and min-p cuts (:class:`SamplingParams`). The top-k
    cut keeps every id tied with the k-th largest logit, as vLLM's does: a rule that does not
    depend on how a sort orders ties, so the device's draw (``draw_graph``) keeps the same ids.

    The cuts are found in log space on the whole vocabulary (the top token is at 0), so only
    the kept ids are exponentiated: on a 262k vocabulary that is what keeps a verify row's
    distribution well under a millisecond."""
    z = penalised_logits(logits, params, history, n_prompt)
    scaled = z - z.max()
    scaled /= params.temperature
    n_vocab = len(scaled)
    keep: np.ndarray | None = None  # None: every id
    if 0 < params.top_k < n_vocab:  # the k-th largest and every id tied with it (vLLM's cut)
        kth = np.partition(scaled, n_vocab - params.top_k)[n_vocab - params.top_k]
        keep = np.flatnonzero(scaled >= kth)
    if params.top_p < 1.0:
        keep = _nucleus(scaled, keep, params.top_p)
    if params.min_p > 0.0:
        floor = math.log(params.min_p)  # the top token, always kept, is at 0
        keep = np.flatnonzero(scaled >= floor) if keep is None else keep[scaled[keep] >= floor]
    if keep is None:
        return Distribution(np.arange(n_vocab), np.exp(scaled))
    return Distribution(keep, np.exp(scaled[keep], dtype=np.float64))


def _nucleus(scaled: np.ndarray, keep: np.ndarray | None, top_p: float) -> np.ndarray:
    """The smallest set of most likely ids (among ``keep``) holding ``top_p`` of their mass,
    ascending. Only ids above a floor are sorted: once the ids above it hold ``top_p``, the
    nucleus cannot reach below it."""
    if keep is None:
        goal = top_p * float(np.exp(scaled).sum(dtype=np.float64))
        for floor in _NUCLEUS_FLOORS:
            ids = np.flatnonzero(scaled >= floor)
            w = np.exp(scaled[ids], dtype=np.float64)
            if w.sum() >= goal:
                break
    else:
        ids, w = keep, np.exp(scaled[keep], dtype=np.float64)
        goal = top_p * w.sum()
    order = np.lexsort((ids, -w))  # most likely first, ties by id
    cut = int(np.searchsorted(np.cumsum(w[order]), goal)) + 1
    return np.sort(ids[order[:cut]])


def top_probability(logits: np.ndarray, token: int) -> float:
    """Softmax probability of ``token`` among ``logits`` (the head's confidence in it).

    Exact, so over the whole row: an estimate from the top candidates (llama.cpp's top-10
    renormalised) overstates the confidence, and finding them costs numpy more than this
    float32 pass (~0.2 ms at 262k ids)."""
    return 1.0 / float(np.exp(logits - logits[token]).sum(dtype=np.float64))


class _RequestSampler:
    """What both samplers keep: the request's parameters, its seed, its prompt length."""

    def __init__(self, params: SamplingParams, seed: int, n_prompt: int) -> None:
        self.params = params
        self.seed = seed
        self.n_prompt = n_prompt
        self.penalised = params.penalised


class GreedySampler(_RequestSampler):
    """Temperature 0: the argmax of the (penalised) logits; drafts are kept while they equal
    it."""


    def draft(self, logits: np.ndarray, position: int, history: Sequence[int],
              p_min: float) -> tuple[int, Distribution | None] | None:
        z = penalised_logits(logits, self.params, history, self.n_prompt)
        token = int(np.argmax(z))
        if p_min > 0 and top_probability(z, token) < p_min:
            return None
        return token, None

    def verify(self, ctx: Context, row0: int, pos0: int, history: Sequence[int],
               draft: Draft, mask: SlotConstraint) -> tuple[int, int]:
        """Rows are read in order up to the first that disagrees, and none after it (a row
        of a 262k vocabulary is a megabyte to reduce: with one slot at acceptance 0.4 about
        half a verify's rows follow its first rejection). Each row's choice is its argmax
        among what ``mask`` allows after the drafts before it (row i has seen drafts 1..i),
        so a draft the raw argmax passed over can still be the masked one. A draft equal to
        its row's raw argmax needs no mask: drafts reach the verify only where the grammar
        allows them (the engine's guide cut the rest)."""
        tokens = draft.tokens
        block = ctx.logits_rows(row0, len(tokens) + 1)
        n = 0
        while True:
            seen = [*history, *tokens[:n]] if self.penalised else history
            row = penalised_logits(block[n], self.params, seen, self.n_prompt)
            choice = int(np.argmax(row))
            if n < len(tokens) and choice == tokens[n]:
                n += 1
                continue
            choice = mask.choose(tokens[:n], row, choice)
            if n == len(tokens) or choice != tokens[n]:
                return n, choice
            n += 1


class RandomSampler(_RequestSampler):
    """Temperature > 0: draws from :func:`target_distribution` with keyed uniforms, and
    verifies drafts by rejection sampling (:func:`accept_or_resample`)."""


    def distribution(self, logits: np.ndarray, history: Sequence[int]) -> Distribution:
        return target_distribution(logits, self.params, history, self.n_prompt)

    def draft(self, logits: np.ndarray, position: int, history: Sequence[int],
              p_min: float) -> tuple[int, Distribution | None] | None:
        q = self.distribution(logits, history)
        token = q.pick(keyed_uniform(self.seed, position, Stream.DRAFT))
        if p_min > 0 and q.prob(token) < p_min:
            return None
        return token, q

    def verify(self, ctx: Context, row0: int, pos0: int, history: Sequence[int],
               draft: Draft, mask: SlotConstraint) -> tuple[int, int]:
        """Row i's target is the distribution of its logits masked after drafts 1..i: the
        masked target, which a grammar-following draft (masked too) is tested against. The
        token a row draws rather than accepts is ``settle``'d (a draft is only ever one the
        constraint would keep: its guide cut the rest), so the output is plain constrained
        sampling's followed by the same settling."""
        tokens = draft.tokens
        penalised = self.penalised
        for i in range(len(tokens) + 1):
            seen = [*history, *tokens[:i]] if penalised else history  # row i saw drafts 1..i
            p = self.distribution(mask.masked(tokens[:i], ctx.logits(row0 + i)), seen)
            u = keyed_uniform(self.seed, pos0 + 1 + i, Stream.TARGET)
            if i == len(tokens):
                return i, mask.settle(tokens[:i], p.pick(u))
            q = draft.dists[i] if draft.dists is not None else Distribution.point(tokens[i])
            accepted, token = accept_or_resample(p, q, tokens[i], u)
            if not accepted:
                return i, mask.settle(tokens[:i], token)
        raise AssertionError("unreachable: the loop returns at the bonus row")


class _DeviceVerify:
    """Verification from the token each row chose on the device: drafts are kept while they
    equal it, and the first that does not (or the bonus row) gives the next token. No logits
    row reaches Python."""

    def _choice(self, ctx: Context, row: int) -> int:
        raise NotImplementedError

    def verify(self, ctx: Context, row0: int, pos0: int, history: Sequence[int],
               draft: Draft, mask: SlotConstraint) -> tuple[int, int]:
        if draft.dists is not None:
            raise ValueError("drafts sampled from a distribution need their rows read: "
                             "verifies_on_device keeps their requests on the host")
        tokens = draft.tokens
        for n, drafted in enumerate(tokens):
            choice = self._choice(ctx, row0 + n)
            if choice != drafted:
                return n, choice
        return len(tokens), self._choice(ctx, row0 + len(tokens))


class DeviceGreedySampler(_DeviceVerify, GreedySampler):
    """Greedy verification from each row's top two, reduced on the device
    (:meth:`~worker.llm.Context.sample_on_device`). Only for a request
    :func:`verifies_on_device` gives True (its target is the raw logits' argmax, unmasked, and
    it asks for no logprobs) or :class:`~worker.llm.device_sampling.Greedy` (the argmax of the
    logits its bias and penalties adjust on the device, bit for bit as
    :func:`penalised_logits`), so each row's choice is :class:`GreedySampler`'s."""

    def _choice(self, ctx: Context, row: int) -> int:
        return ctx.top2(row)[0]


@dataclass(frozen=True)
class KeyedDraws:
    """A sampled request's draws on the device (:class:`~worker.llm.device_sampling.Draws`):
    its temperature, its top-k, top-p and min-p cuts (0, 1 and 0: none), the keyed uniform of
    each position (the very ones :meth:`RandomSampler.verify` uses), and its bias and
    penalties (None: none), each row's adjustment (:class:`~worker.engine.penalties.Penalties`)."""

    seed: int
    temperature: float
    top_k: int = 0
    min_p: float = 0.0
    top_p: float = 1.0
    penalties: Penalties | None = field(default=None, compare=False)

    def uniforms(self, positions: Sequence[int]) -> list[float]:
        return [keyed_uniform(self.seed, p, Stream.TARGET) for p in positions]


class DeviceRandomSampler(_DeviceVerify, RandomSampler):
    """Sampled verification from each row's keyed draw on the device (:class:`KeyedDraws`).
    Only for a request :func:`verifies_on_device` gives draws to: temperature and the top-k
    and min-p cuts on the raw logits, unmasked, no logprobs, point-mass drafts. Such a draft
    is accepted by :func:`accept_or_resample` exactly when plain sampling with the row's
    uniform draws it, and a rejected row's token is that draw: so the row's draw decides both,
    and the output is plain sampling's, as :class:`RandomSampler`'s (to the float32 rounding
    of the device's cumulative sum: docs/sampling.md, "Sampling on the device")."""

    def _choice(self, ctx: Context, row: int) -> int:
        return ctx.sampled(row)


def verifies_on_device(params: SamplingParams, logprobs: int | None, constrained: bool,
                       head_drafts: bool = False,
                       history: list[int] | None = None) -> bool | Greedy | KeyedDraws:
    """How a request's verify rows can be reduced on the device: True (greedy on the raw
    logits: each row's top two), :class:`~worker.llm.device_sampling.Greedy` (greedy with a
    bias or penalties: each row's top two of its adjusted logits), its :class:`KeyedDraws`
    (sampled from the bias, the penalties, the temperature and the top-k, top-p and min-p
    cuts: each row's keyed draw; the seed is fixed here, drawn when the request has none), or
    False (read on the host). Never with a grammar mask or logprobs (they need the row).
    Sampled requests also not when the draft head drafts for them (``head_drafts``: its
    drafts are sampled from its own distribution, and their test needs both distributions'
    values at the draft). A bias or penalties need ``history``, the slot's own list, its
    prompt so far (the device adjusts each row for what it has seen)."""
    if logprobs is not None or constrained or (params.adjusted and history is None):
        return False
    penalties = (Penalties(params, history, len(history))
                 if params.adjusted and history is not None else None)
    if params.greedy:
        return Greedy(penalties) if penalties is not None else True
    if head_drafts:
        return False
    return KeyedDraws(request_seed(params), params.temperature, params.top_k, params.min_p,
                      params.top_p, penalties)


def request_seed(params: SamplingParams) -> int:
    """The request's seed, or one drawn now for a request without (the coordinator gives
    every queued job one at submit; an engine driven directly may not have it)."""
    return params.seed if params.seed is not None else draw_seed()


def make_sampler(params: SamplingParams, n_prompt: int,
                 on_device: bool | Greedy | KeyedDraws = False) -> Sampler:
    """The sampler of one request; ``n_prompt`` tokens of its history are the prompt;
    ``on_device``: how its sequence is sampled on the device (:func:`verifies_on_device`)."""
    if isinstance(on_device, KeyedDraws):
        return DeviceRandomSampler(params, on_device.seed, n_prompt)
    seed = request_seed(params)
    if on_device:
        return DeviceGreedySampler(params, seed, n_prompt)
    if params.greedy:
        return GreedySampler(params, seed, n_prompt)
    return RandomSampler(params, seed, n_prompt)
