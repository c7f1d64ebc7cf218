"""Where each short context occurred in a growing token sequence, and what followed it.

The suffix drafter needs, for the tail of the history, every earlier place that tail appeared,
so it can count how the text went on from each (SuffixDecoding's suffix tree gives the same
occurrence sets). A full suffix tree in Python costs hundreds of bytes per node; this index
keeps, for a few context lengths (:data:`ORDERS`), a dict from the context's hash to its most
recent end position plus one array per length chaining every end position to the previous
occurrence of the same context. Appending a token costs one dict write per order, a lookup a
few probes, and memory is a known few dozen bytes per token and order, so a cache of many
such indexes can be bounded in bytes (:meth:`TokenIndex.nbytes`).

A hash collision only yields a wrong proposal, which verification rejects; it can never
change the output.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

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
#: Bytes per stored token (the token array itself).
BYTES_PER_TOKEN = 8


class TokenIndex:
    """An append-only token sequence with its context index.

    End positions are indexed once they have a follower: a lookup always finds contexts that
    went on, and the sequence's own tail never matches itself.
    """

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        self.tokens: list[int] = []
        #: Per order: each context's hash -> its most recent end position. ``key in
        #: ends[order]`` is the cheapest "did it occur" (the output cache asks it of every
        #: cached output at every draft step).
        self.ends: list[dict[int, int]] = [{} for _ in ORDERS]
        self._prev: list[array[int]] = [array("q") for _ in ORDERS]
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append ``tokens`` and index every context that now has a follower."""
        seq = self.tokens
        for token in tokens:
            end = len(seq) - 1  # the context ending here gets ``token`` as its follower
            seq.append(token)
            if end < 0:
                continue
            for k, n in enumerate(ORDERS):
                if end + 1 < n:
                    self._prev[k].append(-1)
                    continue
                key = hash(tuple(seq[end + 1 - n : end + 1]))
                last = self.ends[k]
                self._prev[k].append(last.get(key, -1))
                last[key] = end

    def occurrences(self, order: int, key: int) -> list[int]:
        """Follower positions (end + 1) of the most recent occurrences of context ``key`` of
        length ``ORDERS[order]``, newest first."""
        end = self.ends[order].get(key, -1)
        chain = self._prev[order]
        found: list[int] = []
        while end >= 0 and len(found) < MAX_OCCURRENCES:
            found.append(end + 1)
            end = chain[end]  # slot e: the previous end of the context ending at e
        return found

    def nbytes(self) -> int:
        """Accounted size: what the cache bounds (see :data:`BYTES_PER_ENTRY`)."""
        return len(self.tokens) * (BYTES_PER_TOKEN + BYTES_PER_ENTRY * len(ORDERS))


def context_keys(history: Sequence[int]) -> list[int | None]:
    """Hash of the last ``n`` tokens of ``history`` per order (None where it is too short);
    computed once per step and probed against every index."""
    return [hash(tuple(history[-n:])) if n <= len(history) else None for n in ORDERS]
