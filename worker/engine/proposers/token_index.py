"""Where each short context occurred in a growing token sequence, and what followed it.

The suffix drafter needs, for the tail of the history, every earlier place that tail appeared,
so it can count how the text went on from each (SuffixDecoding's suffix tree gives the same
occurrence sets). A full suffix tree in Python costs hundreds of bytes per node; this index
keeps, for a few context lengths (:data:`ORDERS`), a dict from the context's hash to its most
recent end position plus one array per length chaining every end position to the previous
occurrence of the same context. Appending a token costs one dict write per order, a lookup a
few probes, and memory is a known few dozen bytes per token and order, so a cache of many
such indexes can be bounded in bytes (:meth:`TokenIndex.nbytes`).

A context's hash is polynomial (a context of ``n`` tokens from ``a`` on:
``prefix[a + n] - prefix[a] * BASE^n``), read off the sequence's prefix hashes
in three integer operations whatever its length: hashing each context's tokens instead
(127 tokens a token over the seven orders, twice: the request's index and its cache entry)
was the suffix drafter's largest host cost on long prompts.

A hash collision only yields a wrong proposal, which verification rejects; it can never
change the output.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from itertools import repeat

import numpy as np

#: Context lengths indexed, longest first. A match is at least as long as the order it was
#: found at; extending it while drafting is exact (the walk filters occurrences token by token).
#: The long orders tell one place in a repetitive text from the others: in JSON records a
#: 16-token tail recurs in every record, a 64-token one only where the same record was written.
ORDERS = (64, 32, 16, 8, 4, 2, 1)
#: At most this many most-recent occurrences are returned per lookup (drafting cost is linear).
MAX_OCCURRENCES = 16
#: Bytes per (token, order): one chain slot (8) plus, for contexts seen once, a dict slot with
#: its key and value ints (measured with tracemalloc on Gemma text: 60-100). Conservative.
BYTES_PER_ENTRY = 120
#: Bytes per stored token (the token list's slot and its prefix hash).
BYTES_PER_TOKEN = 16
#: The polynomial hash of a context ``t_0 .. t_{n-1}``: ``sum (t_j + 1) BASE^(n-1-j)`` modulo
#: 2^64 (an odd multiplier; ``+ 1`` so token 0 counts).
BASE = 0x9E3779B97F4A7C15
MASK = (1 << 64) - 1
#: Appending this many tokens at once indexes them in numpy (:meth:`TokenIndex._extend_many`).
BULK = 32
#: ``(order's slot, length, BASE^length mod 2^64)`` per indexed order.
_ORDER_POWERS = tuple((k, n, pow(BASE, n, MASK + 1)) for k, n in enumerate(ORDERS))


class TokenIndex:
    """An append-only token sequence with its context index.

    End positions are indexed once they have a follower: a lookup always finds contexts that
    went on, and the sequence's own tail never matches itself.
    """

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        self.tokens: list[int] = []
        #: ``prefix[i]``: the hash of ``tokens[:i]`` (a context's hash is two of these).
        self._prefix: array[int] = array("Q", [0])
        #: Per order: each context's hash -> its most recent end position. ``key in
        #: ends[order]`` is the cheapest "did it occur" (the output cache asks it of every
        #: cached output at every draft step, after :meth:`catch_up`).
        self.ends: list[dict[int, int]] = [{} for _ in ORDERS]
        self._prev: list[array[int]] = [array("q") for _ in ORDERS]
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append ``tokens`` and index every context that now has a follower (a prompt's
        worth at once in numpy, :meth:`_extend_many`; a verify's few one by one)."""
        self.append(tokens)
        self.catch_up()

    def append(self, tokens: Iterable[int]) -> None:
        """Append ``tokens`` to :attr:`tokens` now and index them when the index is next
        read (:meth:`catch_up`): a cached output is written at every step and read only
        when another generation looks it up, so its index is mostly built in numpy, many
        tokens at once (at one slot never before its request ends: its own lookups skip it)."""
        self.tokens += tokens

    def catch_up(self) -> None:
        """Index what :meth:`append` left unindexed."""
        indexed = len(self._prefix) - 1
        if indexed == len(self.tokens):
            return
        tokens = self.tokens[indexed:]
        del self.tokens[indexed:]
        if len(tokens) >= BULK:
            self._extend_many(tokens)
            return
        seq, prefix, ends, chains = self.tokens, self._prefix, self.ends, self._prev
        h = prefix[-1]
        for token in tokens:
            end = len(seq) - 1  # the context ending here gets ``token`` as its follower
            for k, n, power in _ORDER_POWERS:
                if end + 1 < n:
                    if end >= 0:
                        chains[k].append(-1)
                    continue
                key = (h - prefix[end + 1 - n] * power) & MASK
                last = ends[k]
                chains[k].append(last.get(key, -1))
                last[key] = end
            seq.append(token)
            h = (h * BASE + token + 1) & MASK
            prefix.append(h)

    def _extend_many(self, tokens: list[int]) -> None:
        """:meth:`extend` for many tokens, in numpy: the same prefix hashes, keys, chains and
        most recent ends as appending them one by one (a 300-token prompt indexed in Python
        cost ~2 ms, twice a request: its own index and its cache entry's lead-in)."""
        old, added = len(self.tokens), len(tokens)
        codes = np.asarray(tokens, dtype=np.uint64) + np.uint64(1)
        powers = _powers(added + 1)
        # prefix[old + j + 1] = prefix[old] B^(j+1) + sum_{i<=j} code_i B^(j-i), the sum as
        # B^j sum_i code_i B^-i (B is odd, so invertible modulo 2^64; numpy wraps).
        inverse = _inverse_powers(added)
        with np.errstate(over="ignore"):
            sums = np.cumsum(codes * inverse, dtype=np.uint64)
            fresh = np.uint64(self._prefix[-1]) * powers[1:] + powers[:-1] * sums
        self._prefix.frombytes(fresh.tobytes())
        self.tokens += tokens
        prefix = np.frombuffer(self._prefix, dtype=np.uint64)
        first_end = max(old - 1, 0)  # the first position this call gives a follower
        last_end = old + added - 2
        for k, n, power in _ORDER_POWERS:
            start = max(first_end, n - 1)
            chain = self._prev[k]
            chain.extend([-1] * max(0, min(start, last_end + 1) - first_end))
            if start > last_end:
                continue
            at = np.arange(start, last_end + 1, dtype=np.intp)
            with np.errstate(over="ignore"):
                keys = prefix[at + 1] - prefix[at + 1 - n] * np.uint64(power)
            order = np.argsort(keys, kind="stable")  # per key, in position order
            ranked, where = keys[order], at[order]
            prev = np.empty(len(at), dtype=np.int64)
            prev[1:] = np.where(ranked[1:] == ranked[:-1], where[:-1], -2)
            prev[0] = -2
            firsts = np.flatnonzero(prev == -2)
            last = self.ends[k]
            # Each key's first end here chains to its most recent end before (none in a new
            # index: a prompt's); map() probes the dict in C, a third of a prompt's indexing.
            prev[firsts] = (list(map(last.get, ranked[firsts].tolist(), repeat(-1))) if last
                            else -1)
            chain.frombytes(prev[np.argsort(order)].tobytes())
            last.update(zip(keys.tolist(), at.tolist(), strict=True))

    def occurrences(self, order: int, key: int) -> list[int]:
        """Follower positions (end + 1) of the most recent occurrences of context ``key`` of
        length ``ORDERS[order]``, newest first."""
        self.catch_up()
        end = self.ends[order].get(key, -1)
        chain = self._prev[order]
        found: list[int] = []
        while end >= 0 and len(found) < MAX_OCCURRENCES:
            found.append(end + 1)
            end = chain[end]  # slot e: the previous end of the context ending at e
        return found

    def tail_keys(self) -> list[int | None]:
        """The hash of the sequence's last ``n`` tokens per order (None where it is
        shorter): what a drafter looks up, in this index and in others."""
        self.catch_up()
        prefix, size = self._prefix, len(self.tokens)
        return [(prefix[size] - prefix[size - n] * power) & MASK if n <= size else None
                for _, n, power in _ORDER_POWERS]

    def nbytes(self) -> int:
        """Accounted size: what the cache bounds (see :data:`BYTES_PER_ENTRY`)."""
        return len(self.tokens) * (BYTES_PER_TOKEN + BYTES_PER_ENTRY * len(ORDERS))


def tail_keys(tokens: Sequence[int]) -> list[int | None]:
    """:meth:`TokenIndex.tail_keys` of a sequence without an index (a drafter asked about a
    history its index does not hold): the same hashes, from the last ``max(ORDERS)`` tokens."""
    keys: dict[int, int] = {}
    key, power, size = 0, 1, len(tokens)
    for n in range(1, min(size, ORDERS[0]) + 1):
        key = (key + (tokens[size - n] + 1) * power) & MASK
        power = (power * BASE) & MASK
        keys[n] = key
    return [keys.get(n) for n in ORDERS]


def _powers(count: int) -> np.ndarray:
    """``BASE^0 .. BASE^(count-1)`` modulo 2^64."""
    with np.errstate(over="ignore"):
        out = np.full(count, BASE, dtype=np.uint64)
        out[0] = 1
        return np.cumprod(out, dtype=np.uint64)


def _inverse_powers(count: int) -> np.ndarray:
    """``BASE^0 .. BASE^-(count-1)`` modulo 2^64."""
    with np.errstate(over="ignore"):
        out = np.full(count, _INVERSE, dtype=np.uint64)
        out[0] = 1
        return np.cumprod(out, dtype=np.uint64)


_INVERSE = pow(BASE, -1, MASK + 1)
