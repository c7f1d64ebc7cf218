"""Where each short context occurred in a growing token sequence, and what followed it.

The suffix drafter needs, for the tail of the history, every earlier place that tail appeared,
so it can count how the text went on from each (SuffixDecoding's suffix tree gives the same
occurrence sets). A full suffix tree costs hundreds of bytes per node; this index keeps, for a
few context lengths (:data:`ORDERS`), a table from the context's hash to its most recent end
position plus one array per length chaining every end position to the previous occurrence of
the same context. Appending a token costs one table write per order, a lookup a few probes,
and memory is a known bound per token (:meth:`TokenIndex.nbytes`), so a cache of many such
indexes can be bounded in bytes.

A context's hash is polynomial (a context of ``n`` tokens from ``a`` on:
``prefix[a + n] - prefix[a] * BASE^n``), read off the sequence's prefix hashes in three
integer operations whatever its length.

:class:`TokenIndex` is native code (``_lookup.c``, built with the package): the drafter looks
its tail up in the request's index and in every cached output's at every draft step, and in
Python those lookups and their catch-up were the largest part of its host time
(``bench/drafter_host.py``; docs/engine.md, "Host work the drafter does every step
anyway"). This module keeps the hash
function in Python (:func:`tail_keys`) for histories without an index.

A hash collision only yields a wrong proposal, which verification rejects; it can never
change the output.
"""

from __future__ import annotations

from collections.abc import Sequence

try:
    from worker.engine.proposers._lookup import (
        BASE,
        MAX_OCCURRENCES,
        ORDERS,
        Calibration,
        TokenIndex,
        follow,
        holding,
    )
except ImportError as exc:  # a gateway-only install: no compiler, no drafter (setup.py)
    raise ImportError(
        "worker.engine.proposers._lookup, the suffix drafter's native token index, is not "
        "built: reinstall specfleet with a C compiler present (pip install -e . or make "
        "install)") from exc

__all__ = ["BASE", "MASK", "MAX_OCCURRENCES", "ORDERS", "Calibration", "TokenIndex", "follow",
           "holding", "tail_keys"]

#: Context lengths indexed (``ORDERS``), longest first: a match is at least as long as the
#: order it was found at; extending it while drafting is exact (the walk filters occurrences
#: token by token). The long orders tell one place in a repetitive text from the others: in
#: JSON records a 16-token tail recurs in every record, a 64-token one only where the same
#: record was written. At most ``MAX_OCCURRENCES`` most-recent occurrences are returned per
#: lookup (drafting cost is linear). The polynomial hash of a context ``t_0 .. t_{n-1}`` is
#: ``sum (t_j + 1) BASE^(n-1-j)`` modulo 2^64 (an odd multiplier; ``+ 1`` so token 0 counts).
MASK = (1 << 64) - 1


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
