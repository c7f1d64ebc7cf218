"""The worker-wide output cache: its bounds, its eviction order, its accounting against the real
allocation, and what a later request drafts from it (the drafter itself, no model needed).
"""

from __future__ import annotations

import random
import tracemalloc
from dataclasses import replace
from typing import cast

import pytest

from worker.engine.core.draft import Draft, VerifyOutcome
from worker.engine.drafting.costs import RowCosts
from worker.engine.proposers.combined import MtpSuffixProposer
from worker.engine.proposers.confidence import FRAGILE_MARGIN, NEAR_TIE_MARGIN
from worker.engine.proposers.mtp import MtpProposer
from worker.engine.proposers.output_cache import Origin, OutputCache
from worker.engine.proposers.repeat_shape import aligned_length, next_verify
from worker.engine.proposers.suffix import SuffixProposer, SuffixShared, no_ends
from worker.engine.proposers.token_index import ORDERS, TokenIndex, tail_keys

#: Verify rows that cost nothing extra: the drafter drafts whatever has any chance.
FREE_ROWS = [0.0] + [1.0] * 17
#: Each extra row costs 0.6 of a decode: only tokens likelier than that are worth a row.
DEAR_ROWS = [0.0] + [1.0 + 0.6 * (r - 1) for r in range(1, 18)]


def _tokens(n: int, seed: int, vocab: int = 262_144) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def _record(cache: OutputCache, tokens: list[int]) -> int:
    entry = cache.open(Origin.of(tokens, 0))
    cache.extend(entry, tokens)
    return entry


def test_byte_bound_evicts_least_recently_used_first() -> None:
    per_output = TokenIndex(_tokens(100, 0)).nbytes()
    cache = OutputCache(max_bytes=3 * per_output, max_entries=64)
    a, b, c = (_record(cache, _tokens(100, s)) for s in (1, 2, 3))
    assert len(cache) == 3 and cache.nbytes <= cache.max_bytes
    cache.touch(a)                     # a draft came from a: b is now the oldest
    d = _record(cache, _tokens(100, 4))
    kept = {entry for entry, _ in cache.others(None)}
    assert kept == {a, c, d} and cache.evictions == 1
    assert cache.nbytes <= cache.max_bytes
    for seed in range(5, 30):          # any amount of traffic stays within the bound
        _record(cache, _tokens(60 + seed, seed))
        assert cache.nbytes <= cache.max_bytes


def test_answers_to_a_prompt_are_the_other_live_entries_for_it_most_recent_first() -> None:
    cache = OutputCache(max_bytes=10**9, max_entries=3)
    asked, other = Origin(11, 4), Origin(22, 4)
    first, elsewhere, second = cache.open(asked), cache.open(other), cache.open(asked)
    assert [e for e, _ in cache.answers(second, asked.prompt)] == [first]
    assert [e for e, _ in cache.answers(None, asked.prompt)] == [second, first]
    cache.touch(first)
    assert [e for e, _ in cache.answers(None, asked.prompt)] == [first, second]
    assert [e for e, _ in cache.answers(None, other.prompt)] == [elsewhere]
    third = cache.open(asked)  # evicts the least recently used: elsewhere
    assert [e for e, _ in cache.answers(None, other.prompt)] == []
    cache.open(other)          # evicts second
    assert [e for e, _ in cache.answers(third, asked.prompt)] == [first]


def test_outputs_holding_a_context_are_those_it_occurred_in_most_recent_first() -> None:
    cache = OutputCache(max_bytes=10**9, max_entries=8)
    shared_run = [7, 8, 9, 10]
    a = _record(cache, [1, 2, *shared_run, 3])
    b = _record(cache, [4, *shared_run, 5])
    _record(cache, [6, 11, 12, 13, 14])
    order = ORDERS.index(4)
    key = tail_keys(shared_run)[order]
    assert key is not None
    assert [e for e, _ in cache.holding(order, key, None)] == [b, a]
    cache.touch(a)
    assert [e for e, _ in cache.holding(order, key, None)] == [a, b]
    assert [e for e, _ in cache.holding(order, key, a)] == [b]  # never the asking entry
    # A context only at an output's end has no follower there: nothing to draft from it.
    tail = tail_keys([11, 12, 13, 14])[order]
    assert tail is not None and cache.holding(order, tail, None) == []


def test_the_index_finds_every_context_where_a_search_of_the_tokens_does() -> None:
    """The prefix hashes index each context under the key its tail is looked up with, at
    every order, however the sequence was appended: the index's occurrences are exactly
    the earlier places the tail's tokens occur (with a follower), newest first."""
    rng = random.Random(5)
    tokens = [rng.randrange(6) for _ in range(400)]  # a small alphabet: many repeats
    index = TokenIndex(tokens[:150])
    for i in range(150, 400, 7):
        index.extend(tokens[i:i + 7])
    # Appended unindexed (a cached output is indexed when it is looked up), in runs of one
    # to 40 tokens between lookups: indexed one by one and in numpy alike.
    appended, at = TokenIndex(), 0
    while at < len(tokens):
        step = rng.choice((1, 2, 3, 40))
        appended.append(tokens[at:at + step])
        at += step
        if rng.random() < 0.3:
            appended.catch_up()
    for end in (3, 40, 130, 399):
        seq = tokens[:end + 1]
        keys = tail_keys(seq)
        assert TokenIndex(seq).tail_keys() == keys
        for order, n in enumerate(ORDERS):
            if n > len(seq):
                assert keys[order] is None
                continue
            tail = seq[-n:]
            found = [s + n for s in range(len(tokens) - n) if tokens[s:s + n] == tail]
            assert index.occurrences(order, keys[order])[:5] == found[::-1][:5], (end, n)
            assert appended.occurrences(order, keys[order])[:5] == found[::-1][:5], (end, n)


def test_entry_bound_and_an_output_larger_than_the_cache() -> None:
    cache = OutputCache(max_bytes=10**9, max_entries=2)
    first = _record(cache, [1, 2, 3])
    _record(cache, [4, 5, 6])
    _record(cache, [7, 8, 9])
    assert len(cache) == 2 and first not in {e for e, _ in cache.others(None)}
    small = OutputCache(max_bytes=TokenIndex(_tokens(10, 0)).nbytes(), max_entries=8)
    kept = _record(small, _tokens(10, 1))
    huge = _record(small, _tokens(50, 2))
    assert [e for e, _ in small.others(None)] == [kept]  # the huge one is not recorded
    small.extend(huge, [1, 2])                            # and stays out
    assert len(small) == 1 and small.nbytes <= small.max_bytes
    with pytest.raises(ValueError):
        OutputCache(max_bytes=-1)


def test_accounted_bytes_cover_the_real_allocation() -> None:
    """The bound is only a bound if the accounting is at least what Python allocates: worst
    case, every context unique (random tokens of a 262k vocabulary)."""
    tokens = _tokens(20_000, 7)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = TokenIndex(tokens)
        allocated = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert allocated <= index.nbytes()
    assert index.nbytes() < 3 * allocated  # and not wildly pessimistic


def _commit(proposer: SuffixProposer, history: list[int], tokens: list[int]) -> None:
    """Tell ``proposer`` a plain step committed ``tokens`` (bonus last) after ``history``."""
    *accepted, bonus = tokens
    proposer.observe(VerifyOutcome(len(history) - 1, history[-1], list(accepted),
                                   len(accepted), bonus))
    history += tokens


def test_a_later_request_drafts_from_an_earlier_output() -> None:
    shared = SuffixShared(RowCosts(FREE_ROWS), OutputCache(max_bytes=10**7))
    earlier = SuffixProposer(shared)
    history = [900, 901, 902]
    earlier.start(history)
    written = list(range(100, 140))
    _commit(earlier, history, written)

    later = SuffixProposer(shared)
    prompt = [7, 8, 100, 101, 102, 103]     # quotes the start of the earlier output
    later.start(prompt)
    draft = later.propose(prompt, 8, 0.0).tokens
    assert draft == list(range(104, 112))
    # Without the cache the same request has nothing to draft from.
    alone = SuffixProposer(SuffixShared(RowCosts(FREE_ROWS), OutputCache(max_bytes=10**7)))
    alone.start(prompt)
    assert alone.propose(prompt, 8, 0.0).tokens == []


def test_drafts_follow_the_majority_and_stop_where_occurrences_disagree() -> None:
    """``k: v`` records with the same keys and different values: the drafter proposes the
    repeated key but not the value after it (rows that cost 0.6 of a decode)."""
    shared = SuffixShared(RowCosts(DEAR_ROWS), OutputCache(max_bytes=10**7))
    proposer = SuffixProposer(shared)
    key, sep, end = [50, 51], 52, 53
    records = [[*key, sep, value, end] for value in (60, 61, 62, 63)]
    history = [token for record in records for token in record] + [*key]
    proposer.start(history)
    draft = proposer.propose(history, 8, 0.0).tokens
    assert draft == [sep]   # four different values followed it: not worth a row
    # The same history with free rows drafts on: the cut was the cost rule's.
    free = SuffixProposer(SuffixShared(RowCosts(FREE_ROWS), OutputCache(max_bytes=10**7)))
    free.start(history)
    assert free.propose(history, 8, 0.0).tokens[:2] == [sep, 63]  # newest value on a tie


def test_a_repeated_request_drafts_its_earlier_output_from_the_first_step() -> None:
    """The cache entry starts with the prompt's tail, so the very first draft of a repeat
    (whose tail is all prompt) already continues with what the earlier run wrote."""
    shared = SuffixShared(RowCosts(FREE_ROWS), OutputCache(max_bytes=10**7))
    prompt = [300 + i for i in range(40)]
    earlier = SuffixProposer(shared)
    earlier.start(prompt)
    history = list(prompt)
    _commit(earlier, history, [7, 3, 9, 1, 4, 4, 8, 2, 6, 5])
    repeat = SuffixProposer(shared)
    repeat.start(prompt)
    assert repeat.propose(prompt, 6, 0.0).tokens == [7, 3, 9, 1, 4, 4]


def test_a_loop_in_the_request_drafts_past_one_period() -> None:
    """A text that has repeated a 5-token phrase twice drafts on around the loop, as an
    n-gram lookup over history plus draft does; a cached output does not wrap."""
    loop = [11, 12, 13, 14, 15]
    history = [1, 2, *loop, *loop]
    proposer = SuffixProposer(SuffixShared(RowCosts(FREE_ROWS), OutputCache(max_bytes=10**7)))
    proposer.start(history)
    assert proposer.propose(history, 12, 0.0).tokens == (loop * 3)[:12]
    shared = SuffixShared(RowCosts(FREE_ROWS), OutputCache(max_bytes=10**7))
    earlier = SuffixProposer(shared)
    earlier.start([1, 2])
    _commit(earlier, [1, 2], [*loop, 99])
    later = SuffixProposer(shared)
    later.start([3, 11, 12])
    assert later.propose([3, 11, 12], 12, 0.0).tokens == [13, 14, 15, 99]


def test_another_request_ending_alike_is_not_answered_with_the_earlier_answer() -> None:
    """Two prompts that end with the same 40 tokens (the same code after different
    instructions): the second does not draft the first's answer at its first step, as a
    repeat would, but does draft from it once its own output starts the same way."""
    shared = SuffixShared(RowCosts(FREE_ROWS), OutputCache(max_bytes=10**7))
    code = [300 + i for i in range(40)]
    earlier = SuffixProposer(shared)
    earlier.start([1, 2, *code])
    _commit(earlier, [1, 2, *code], [7, 3, 9, 1, 4, 4, 8, 2, 6, 5])
    other = SuffixProposer(shared)
    history = [5, 6, *code]
    other.start(history)
    assert other.propose(history, 6, 0.0).tokens == []
    _commit(other, history, [7, 3])
    assert other.propose(history, 6, 0.0).tokens == [9, 1, 4, 4, 8, 2]
    repeat = SuffixProposer(shared)
    repeat.start([1, 2, *code])
    assert repeat.propose([1, 2, *code], 6, 0.0).tokens == [7, 3, 9, 1, 4, 4]


def test_a_request_whose_drafts_keep_failing_drafts_less_and_recovers() -> None:
    """A repeat whose output leaves the cached one: its drafts from the cache are rejected at
    once. Its own record scales its confidences down until the cost rule stops drafting,
    while a fresh request on the same cells still drafts; plain verifies give them back
    (rows that cost 0.6 of a decode)."""
    shared = SuffixShared(RowCosts(DEAR_ROWS), OutputCache(max_bytes=10**7))
    prompt = [300 + i for i in range(40)]
    earlier = SuffixProposer(shared)
    earlier.start(prompt)
    _commit(earlier, list(prompt), list(range(1000, 1200)))
    repeat = SuffixProposer(shared)
    repeat.start(prompt)
    history = [*prompt, *range(1000, 1100)]  # deep inside the cached output

    def verify(draft: list[int], n_accepted: int) -> None:
        repeat.observe(VerifyOutcome(len(history) - 1, history[-1], draft, n_accepted, 7))

    widths = [len(repeat.propose(history, 8, 0.0).tokens)]
    while widths[-1] and len(widths) < 4:
        verify(repeat.propose(history, 8, 0.0).tokens, 0)
        widths.append(len(repeat.propose(history, 8, 0.0).tokens))
    assert widths[0] > 0 and widths[-1] == 0, widths
    fresh = SuffixProposer(shared)
    fresh.start(prompt)
    drafted = fresh.propose(history, 8, 0.0).tokens
    assert len(drafted) > 0  # the cells alone still draft
    for _ in range(100):  # plain steps: the record decays back to "as promised"
        repeat.propose(history, 0, 0.0)
        verify([], 0)
    assert repeat.propose(history, 8, 0.0).tokens == drafted  # as a fresh request would


def _greedy(proposer: SuffixProposer, history: list[int], truth: list[int],
            width: int) -> list[tuple[int, list[int], int]]:
    """Run ``proposer`` as the engine would while the target writes ``truth``: each step's
    draft is accepted as far as it agrees with ``truth`` and the next true token is the
    bonus. Returns every step's (index into ``truth`` it drafted from, draft, accepted)."""
    steps: list[tuple[int, list[int], int]] = []
    done = 0
    while done < len(truth):
        draft = proposer.propose(history, min(width, len(truth) - done - 1), 0.0).tokens
        n = 0
        while n < len(draft) and draft[n] == truth[done + n]:
            n += 1
        proposer.observe(VerifyOutcome(len(history) - 1, history[-1], draft, n,
                                       truth[done + n]))
        history += truth[done:done + n + 1]
        steps.append((done, draft, n))
        done += n + 1
    return steps


def test_a_request_drafts_its_own_structure_where_the_cache_outvotes_it() -> None:
    """Records ``filler key sep value``: an earlier output wrote value 60 sixteen times, this
    request writes 70. At the value both sources match ``key sep`` alike; pooled, the cache's
    sixteen outvote the request's own few and every value drafted is rejected. Walked apart,
    the cached continuation is tried first (sixteen agreeing occurrences), fails, and the
    request's own records carry the values from then on."""
    key, sep = 50, 51
    shared = SuffixShared(RowCosts(FREE_ROWS), OutputCache(max_bytes=10**7))
    earlier = SuffixProposer(shared)
    earlier.start([900, 901])
    _commit(earlier, [900, 901], [t for j in range(16) for t in (2000 + j, key, sep, 60)])
    repeat = SuffixProposer(shared)
    repeat.start([800, 801])
    truth = [t for i in range(12) for t in (3000 + i, key, sep, 70)]
    steps = _greedy(repeat, [800, 801], truth, 4)
    # What each step drafted at a value position (truth index 3, 7, ...), in order.
    at_values = [(draft[j - done], j - done < n) for done, draft, n in steps
                 for j in range(done, done + len(draft)) if j % 4 == 3]
    assert at_values[0] == (60, False), steps  # the cache's majority first
    assert sum(ok for _, ok in at_values) >= 9, steps


def test_a_repeat_drafts_its_earlier_output_only_up_to_a_near_tie() -> None:
    """The earlier run chose its 4th token by a hair (a margin below ``NEAR_TIE_MARGIN``): a
    repeat's verify, batched otherwise, may choose the other token there and part from the
    cached answer. With rows that cost 0.6 of a decode its draft stops before that token; the
    same output recorded with firm margins is drafted past it. Where rows cost half that, a
    token that was fragile but not that close is drafted past too (most repeats keep those)
    and the near-tie still is not. The calibration then learns
    how such tokens went: where rows are free the repeats draft through it, and after forty
    that kept it, the dear rows' draft goes past it too."""
    prompt = [300 + i for i in range(40)]
    written = [7, 3, 9, 1, 4, 4, 8, 2, 6, 5, 11, 12]
    near_tie = 3

    def recorded(rows: list[float], margins: list[float]) -> SuffixShared:
        shared = SuffixShared(RowCosts(rows), OutputCache(max_bytes=10**7),
                              margins=lambda row0, tokens: margins[:len(tokens)])
        earlier = SuffixProposer(shared)
        earlier.start(prompt)
        _commit(earlier, list(prompt), written)
        return shared

    def repeat(shared: SuffixShared) -> tuple[SuffixProposer, list[int]]:
        proposer = SuffixProposer(shared)
        proposer.start(prompt)
        return proposer, proposer.propose(prompt, 10, 0.0).tokens

    firm = [5.0] * len(written)
    past = repeat(recorded(DEAR_ROWS, firm))[1]
    assert past == written[:len(past)] and len(past) > near_tie + 1
    shaky = [*firm[:near_tie], NEAR_TIE_MARGIN / 3, *firm[near_tie + 1:]]
    dear = recorded(DEAR_ROWS, shaky)
    assert repeat(dear)[1] == written[:near_tie]
    # Chosen by a margin below FRAGILE_MARGIN but not a near-tie: most repeats keep it, so
    # where rows cost 0.3 of a decode the draft goes past it (and still not past a near-tie).
    cheaper = [0.0] + [1.0 + 0.3 * (r - 1) for r in range(1, 18)]
    close = [*firm[:near_tie], (NEAR_TIE_MARGIN + FRAGILE_MARGIN) / 2, *firm[near_tie + 1:]]
    kept = repeat(recorded(cheaper, close))[1]
    assert kept == written[:len(kept)] and len(kept) > near_tie + 1
    assert repeat(recorded(cheaper, shaky))[1] == written[:near_tie]

    free = replace(dear, costs=RowCosts(FREE_ROWS))
    for _ in range(40):
        proposer, draft = repeat(free)
        assert draft == written[:10]
        proposer.observe(VerifyOutcome(len(prompt) - 1, prompt[-1], draft, 10, written[10]))
    learned = repeat(replace(free, costs=RowCosts(DEAR_ROWS)))[1]
    assert learned == written[:len(learned)] and len(learned) > near_tie + 1


def test_a_near_ties_verify_is_made_in_its_shape_by_cutting_the_drafts_before_it() -> None:
    """Output token 7 was chosen by the first row of a 4-row verify (it started at 7), token
    20 by the third row of a 12-row one (started at 18)."""
    shapes = {20: (2, 12), 7: (0, 4)}
    assert next_verify(0, shapes) == next_verify(7, shapes) == (7, 4)
    assert next_verify(8, shapes) == next_verify(18, shapes) == (18, 12)
    assert next_verify(19, shapes) is None and next_verify(0, {}) is None  # passed or missed
    assert aligned_length(11, 0, (7, 4)) == 6      # commits 0-6, so the next verify starts at 7
    assert aligned_length(3, 0, (7, 4)) == 3       # ends before 7 anyway
    assert aligned_length(11, 7, (7, 4)) == 3      # 4 rows: the last token and 3 drafted
    assert aligned_length(2, 7, (7, 4)) == 2       # the drafter wants fewer: not padded
    assert aligned_length(30, 8, (18, 12)) == 9
    assert aligned_length(30, 17, (18, 12)) == 0   # a plain step commits 17
    assert aligned_length(30, 18, (18, 12)) == 11


SHAPED_PROMPT = [300 + i for i in range(40)]
SHAPED_ANSWER = list(range(500, 530))


def _near_tie_at_4(alone: bool) -> SuffixShared:
    """An engine's drafter state after one answer: 4 tokens committed, then token 4 chosen
    by a hair at the first row of a 4-row verify (``alone``: it had the decode to itself),
    then the rest."""
    margins: list[float] = []
    shared = SuffixShared(RowCosts(FREE_ROWS), OutputCache(max_bytes=10**7),
                          margins=lambda row0, tokens: margins[:len(tokens)])
    earlier = SuffixProposer(shared)
    earlier.start(SHAPED_PROMPT)
    margins[:] = [5.0] * 4
    _commit(earlier, list(SHAPED_PROMPT), SHAPED_ANSWER[:4])
    margins[:] = [NEAR_TIE_MARGIN / 3, 5.0, 5.0, 5.0]
    earlier.observe(VerifyOutcome(len(SHAPED_PROMPT) + 3, SHAPED_ANSWER[3], SHAPED_ANSWER[4:7],
                                  3, SHAPED_ANSWER[7], alone=alone))
    margins[:] = [5.0] * 22
    _commit(earlier, [*SHAPED_PROMPT, *SHAPED_ANSWER[:8]], SHAPED_ANSWER[8:])
    return shared


def test_a_repeat_verifies_a_near_tie_in_the_shape_of_the_verify_that_chose_it() -> None:
    """A repeat of :func:`_near_tie_at_4`'s request: its first draft ends so that its bonus
    is token 3, its next holds 4 rows from token 4, and then it drafts as far as it likes.
    Where that verify shared its decode with other slots, its shape says nothing about the
    rows that chose the token, and the repeat drafts on through it."""
    prompt, written = SHAPED_PROMPT, SHAPED_ANSWER
    repeat = SuffixProposer(_near_tie_at_4(alone=True))
    repeat.start(prompt)
    history, drafts = list(prompt), []
    while len(history) < len(prompt) + 12:
        draft = repeat.propose(history, 16, 0.0).tokens
        drafts.append((len(draft), repeat.shaped))
        done = len(history) - len(prompt)
        assert draft == written[done:done + len(draft)]
        _commit(repeat, history, written[done:done + len(draft) + 1])
    assert drafts == [(3, True), (3, True), (16, False)]

    unaligned = SuffixProposer(_near_tie_at_4(alone=False))
    unaligned.start(prompt)
    assert unaligned.propose(prompt, 16, 0.0).tokens == written[:16]
    assert not unaligned.shaped


class _LongHead:
    """An MTP head that always drafts 8 tokens (the combined drafter's other half)."""

    def start(self, prompt: list[int]) -> None:
        pass

    def propose(self, history: list[int], width: int, p_min: float) -> Draft:
        return Draft([1] * 8)

    def observe(self, outcome: VerifyOutcome) -> None:
        pass


def test_the_combined_drafter_keeps_a_repeats_shaped_draft_over_a_longer_heads() -> None:
    """MTP plus lookup verifies the longer draft, except a repeat's cut to a near-tie's
    shape: the head's 8 tokens would make the verify the near-tie was to be chosen in
    another shape. Where nothing is to be shaped, the longer one is verified as before."""
    shaped = SuffixProposer(_near_tie_at_4(alone=True))
    combined = MtpSuffixProposer(cast(MtpProposer, _LongHead()), shaped)
    combined.start(SHAPED_PROMPT)
    assert combined.propose(SHAPED_PROMPT, 16, 0.0).tokens == SHAPED_ANSWER[:3]
    plain = MtpSuffixProposer(cast(MtpProposer, _LongHead()),
                              SuffixProposer(SuffixShared(RowCosts(FREE_ROWS),
                                                          OutputCache(max_bytes=10**7))))
    plain.start(SHAPED_PROMPT)
    assert plain.propose(SHAPED_PROMPT, 16, 0.0).tokens == [1] * 8


def test_the_requests_own_text_drafts_no_end_of_generation() -> None:
    """A story that quotes the user's last words: in the prompt they are followed by the
    chat template's end of turn, which the answer does not write there. The request's own
    text drafts the quote and stops before the end; a cached output that ended there
    drafts its end (a repeat ends there too)."""
    end, turn = 900, [901, 902]
    words = [50, 51, 52, 53, 54, 55]
    prompt = [10, 11, *words, end, *turn]

    def own_draft(ends: bool) -> list[int]:
        shared = SuffixShared(RowCosts(FREE_ROWS), OutputCache(max_bytes=10**7),
                              ends=(lambda t: t == end) if ends else no_ends)
        proposer = SuffixProposer(shared)
        proposer.start(prompt)
        history = [*prompt, 60, 61, *words[:4]]
        return proposer.propose(history, 8, 0.0).tokens

    assert own_draft(ends=False)[:3] == [*words[4:], end]  # what the lookup alone says
    assert own_draft(ends=True) == words[4:]

    shared = SuffixShared(RowCosts(FREE_ROWS), OutputCache(max_bytes=10**7),
                          ends=lambda t: t == end)
    earlier = SuffixProposer(shared)
    earlier.start([20, 21])
    _commit(earlier, [20, 21], [*words, end])
    repeat = SuffixProposer(shared)
    repeat.start([20, 21])
    assert repeat.propose([20, 21], 8, 0.0).tokens == [*words, end]


def _answered(prompt: list[int], answer: list[int]) -> SuffixShared:
    """Drafter state whose output cache holds ``answer`` to ``prompt``."""
    shared = SuffixShared(RowCosts(FREE_ROWS), OutputCache(max_bytes=10**7))
    earlier = SuffixProposer(shared)
    earlier.start(prompt)
    _commit(earlier, list(prompt), list(answer))
    return shared


def _again(prompt: list[int], earlier_answer: list[int], written: list[int]) -> Draft:
    """The draft of a request for ``prompt`` once it has written ``written``, after an
    earlier request for the same prompt answered ``earlier_answer``; it drafts at every step,
    as the engine asks it to, and commits one token a step."""
    again = SuffixProposer(_answered(prompt, earlier_answer))
    again.start(prompt)
    history = list(prompt)
    for token in written:
        again.propose(history, 8, 0.0)
        _commit(again, history, [token])
    return again.propose(history, 8, 0.0)


def test_a_repeat_of_a_short_prompt_is_as_sure_as_a_repeat_of_a_long_one() -> None:
    """A repeat matches its earlier answer as a whole request (the same prompt, the same
    output so far), not as deep as its tail happens to be: a 10-token prompt's repeat drafts
    the earlier answer with the confidence of a 100-token prompt's, from the first step and
    after some of it was written, and a repeat that parted from it no longer counts so."""
    answer = _tokens(40, seed=5)
    short, long = _tokens(10, seed=6), _tokens(100, seed=7)
    for after in (0, 3):
        draft = _again(short, answer, answer[:after])
        assert draft.tokens == answer[after:after + 8]
        assert draft.confidences == pytest.approx(_again(long, answer, answer[:after])
                                                  .confidences)
    # Parted at its first token, then back on the earlier answer's second and third: only
    # its 2-token tail matches there, a weaker guess than the repeat's.
    in_step = _again(short, answer, answer[:3]).confidences or []
    parted = _again(short, answer, [answer[0] + 1, *answer[1:3]])
    assert parted.tokens[:1] == answer[3:4]
    assert (parted.confidences or [1.0])[0] < in_step[0]
    # Parted late (at its 6th token), then back on the answer for 3 tokens: still parted.
    late = _again(short, answer, [*answer[:5], answer[5] + 1, *answer[6:9]])
    assert late.tokens[:1] == answer[9:10]
    assert (late.confidences or [1.0])[0] < (_again(short, answer, answer[:9]).confidences
                                             or [0.0])[0]


def test_a_drafter_started_again_forgets_which_answers_its_last_request_left() -> None:
    """A slot's drafter serves request after request: one that parted from the cached answer
    does not keep the next request for the same prompt from matching it as a whole request
    (guessed at 0.99, not as the 8-token tail coincidence it also is, 0.875)."""
    prompt, answer = _tokens(10, seed=8), _tokens(20, seed=9)
    slot = SuffixProposer(_answered(prompt, answer))
    slot.start(prompt)
    history = list(prompt)
    slot.propose(history, 8, 0.0)
    _commit(slot, history, [answer[0] + 1])       # parted at once
    slot.propose(history, 8, 0.0)
    slot.start(prompt)                            # the next request, the same prompt
    history = list(prompt)
    slot.propose(history, 8, 0.0)
    _commit(slot, history, answer[:1])            # keeps to the answer this time
    draft = slot.propose(history, 8, 0.0)
    assert draft.tokens == answer[1:9]
    assert (draft.confidences or [0.0])[0] == pytest.approx(0.99)
