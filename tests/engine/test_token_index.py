"""The native token index and walk (``worker/engine/proposers/_lookup.c``) against plain Python
statements of what they must do: the walk's token choice, agreement, fragility and wrapping,
the index as a sequence, its byte accounting at every size, and its copies."""

from __future__ import annotations

import copy
import pickle
import random

import pytest

from worker.engine.proposers.token_index import ORDERS, TokenIndex, follow, tail_keys

Occurrence = tuple[TokenIndex, int, dict[int, int]]


def _reference_walk(occurrences: list[Occurrence], width: int, wraps: bool,
                    stop_at: int) -> list[tuple[int, int, int, int, int]]:
    """What ``follow`` must offer ``take``, step by step, written the slow obvious way: the
    token most live occurrences go on with (ties: the earliest occurrence's), how many are
    live, how many agree, the highest fragility an agreeing one holds it at; ``take``
    refuses the step ``stop_at``."""
    live = [(list(index.tokens), start, fragile) for index, start, fragile in occurrences]
    walked: list[int] = []
    offered = []
    for i in range(width):
        going = []
        for seq, start, fragile in live:
            j = start + i
            if j < len(seq):
                going.append(((seq, start, fragile), seq[j]))
            elif wraps and j - len(seq) < len(walked):
                going.append(((seq, start, fragile), walked[j - len(seq)]))
        if not going:
            break
        tokens = [t for _, t in going]
        token = max(tokens, key=lambda t: (tokens.count(t), -tokens.index(t)))
        agreeing = [occ for occ, t in going if t == token]
        fragile = max(f.get(occ[1] + i, 0) for occ in agreeing for f in (occ[2],))
        offered.append((i, token, len(going), len(agreeing), fragile))
        if i == stop_at:
            break
        walked.append(token)
        live = agreeing
    return offered


@pytest.mark.parametrize("seed", range(40))
def test_the_walk_offers_what_a_plain_walk_of_the_occurrences_finds(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = rng.choice((2, 3, 5))  # small: occurrences agree, part and tie
    indexes = [TokenIndex([rng.randrange(alphabet) for _ in range(rng.randrange(4, 60))])
               for _ in range(rng.randrange(1, 4))]
    occurrences: list[Occurrence] = []
    for _ in range(rng.randrange(1, 12)):
        index = rng.choice(indexes)
        start = rng.randrange(1, len(index))
        fragile = ({p: rng.choice((1, 2)) for p in rng.sample(range(len(index)), 5)}
                   if rng.random() < 0.5 else {})
        occurrences.append((index, start, fragile))
    width, wraps = rng.randrange(1, 40), rng.random() < 0.5
    stop_at = rng.randrange(0, 50)
    offered: list[tuple[int, int, int, int, int]] = []

    def take(i: int, token: int, support: int, agree: int, fragile: int) -> bool:
        offered.append((i, token, support, agree, fragile))
        return i != stop_at

    follow(occurrences, width, wraps, take)
    assert offered == _reference_walk(occurrences, width, wraps, stop_at)


def test_a_request_looping_on_itself_is_walked_past_its_end() -> None:
    """The request's own text repeating with period 3: the occurrence three back goes on
    with the draft itself when ``wraps``, and ends with the text when not."""
    index = TokenIndex([1, 2, 3, 1, 2, 3, 1, 2])
    seen: dict[bool, list[int]] = {True: [], False: []}
    for wraps in (True, False):
        follow([(index, 5, {})], 10, wraps,
               lambda i, token, *_, w=wraps: seen[w].append(token) is None)
    assert seen[True] == [3, 1, 2, 3, 1, 2, 3, 1, 2, 3]
    assert seen[False] == [3, 1, 2]


def test_the_walk_refuses_what_is_not_an_occurrence() -> None:
    with pytest.raises(TypeError, match="triples"):
        follow([([1, 2, 3], 1, {})], 4, False, lambda *_: True)  # type: ignore[list-item]
    with pytest.raises(ZeroDivisionError):  # take's own error comes through
        follow([(TokenIndex([1, 2, 3]), 1, {})], 4, False, lambda *_: 1 / 0)


def test_the_index_reads_as_its_token_sequence() -> None:
    tokens = [5, 0, 262_143, 7, 7, 2**40]
    index = TokenIndex()
    index.append(tokens[:2])
    index.extend(tokens[2:])
    assert len(index) == len(tokens) and index.tokens == tokens
    assert [index[i] for i in range(-6, 6)] == tokens[-6:] + tokens
    for a, b in ((0, 6), (2, 4), (4, 2), (-3, None), (None, 100), (7, 9)):
        assert index[a:b] == tokens[a:b]
    with pytest.raises(IndexError):
        index[6]
    with pytest.raises(ValueError, match="step 1"):
        index[::2]
    with pytest.raises(ValueError, match="negative"):
        index.append([-1])
    with pytest.raises(IndexError, match="order 7"):
        index.occurrences(len(ORDERS), 0)


def test_a_copy_is_an_index_of_the_same_tokens() -> None:
    rng = random.Random(3)
    tokens = [rng.randrange(4) for _ in range(300)]
    index = TokenIndex(tokens[:200])
    index.append(tokens[200:])  # not yet indexed: a copy still finds them
    keys = tail_keys(tokens[:150])
    for clone in (copy.deepcopy(index), pickle.loads(pickle.dumps(index))):
        assert clone.tokens == tokens and clone is not index
        assert [clone.occurrences(k, key) for k, key in enumerate(keys)] == \
            [index.occurrences(k, key) for k, key in enumerate(keys)]


@pytest.mark.parametrize("vocab", [3, 262_144])
def test_the_accounted_bytes_bound_the_allocation_at_every_size(vocab: int) -> None:
    """What the output cache counts (``nbytes``) is at least what the arrays and tables hold,
    from an empty index on, through every doubling, however repetitive the text."""
    rng = random.Random(vocab)
    index = TokenIndex()
    for _ in range(3000):
        index.append([rng.randrange(vocab) for _ in range(rng.choice((1, 3, 17)))])
        index.catch_up()
        assert index.allocated() <= index.nbytes(), len(index)
