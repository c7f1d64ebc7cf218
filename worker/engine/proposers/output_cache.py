"""The worker's recent outputs, per model, that later generations draft from.

llama-server's ngram-mod table and SuffixDecoding's global tree both learn across requests: a
repeated or similar request copies what an earlier one wrote. Here every generation's output
is indexed as it grows (:class:`TokenIndex`), and the suffix drafter looks its history's tail
up in the other outputs too. Nothing from the cache can reach another request's output: a
looked-up token is only a proposal, and the target's own argmax decides every token.

Memory is bounded in bytes (accounted by :meth:`TokenIndex.nbytes`, checked against the real
allocation in the tests) and in entries (each is probed once per draft step); the least
recently used output is evicted first, and an output that alone would exceed the bound stops
being recorded. The bound is what the fitter counts for the cache (``lookup_cache``).

Each entry also keeps where its output is *fragile*: the positions of tokens the target chose
by a margin below :data:`~worker.engine.proposers.confidence.FRAGILE_MARGIN`, where a repeat
may part from it, and how close each was (:func:`~worker.engine.proposers.confidence.fragility`),
and for each near-tie the shape of the verify that chose it, where that verify had the decode
to itself (:mod:`~worker.engine.proposers.repeat_shape`: a repeat verifies it in that shape).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import count

from shared.logs import get_logger
from worker.engine.proposers.confidence import NEAR_TIE, fragility
from worker.engine.proposers.repeat_shape import Shape
from worker.engine.proposers.token_index import TokenIndex, holding

log = get_logger("engine.output_cache")

#: Default bound of a worker's output cache (bytes).
DEFAULT_CACHE_BYTES = 32 * 1024 * 1024
#: At most this many outputs are kept (each costs a few dict probes per draft step).
MAX_ENTRIES = 64
#: Bytes accounted per fragile position (a dict entry and its int, with room to spare).
BYTES_PER_FRAGILE = 96


@dataclass(frozen=True)
class Origin:
    """Which request an output answers: a hash of its whole prompt, and how many of the
    prompt's last tokens the entry starts with before the output (its lead-in)."""

    prompt: int
    lead_in: int

    @classmethod
    def of(cls, prompt: Sequence[int], lead_in: int) -> Origin:
        return cls(hash(tuple(prompt)), min(lead_in, len(prompt)))


class OutputCache:
    """Bounded, least-recently-used store of recent outputs' indexes."""

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES,
                 max_entries: int = MAX_ENTRIES) -> None:
        if max_bytes < 0 or max_entries < 1:
            raise ValueError(f"cache bounds must be max_bytes >= 0 and max_entries >= 1, got "
                             f"{max_bytes} and {max_entries}")
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._entries: OrderedDict[int, TokenIndex] = OrderedDict()
        self._bytes: dict[int, int] = {}
        #: The sum of :attr:`_bytes`, kept as they change (every verify extends an entry).
        self._total = 0
        self._origins: dict[int, Origin] = {}
        #: Entries per prompt hash: a repeat's lookup of earlier answers to its prompt, at
        #: every draft step, costs nothing while there are none (the usual case).
        self._by_prompt: dict[int, set[int]] = {}
        self._fragile: dict[int, dict[int, int]] = {}
        self._shapes: dict[int, dict[int, Shape]] = {}
        self._ids = count()
        self.evictions = 0

    def open(self, origin: Origin) -> int:
        """Start recording a new output of the request ``origin`` describes; returns its id
        (evicting to make room for it)."""
        entry = next(self._ids)
        self._entries[entry] = TokenIndex()
        self._bytes[entry] = 0
        self._origins[entry] = origin
        self._by_prompt.setdefault(origin.prompt, set()).add(entry)
        self._fragile[entry] = {}
        self._shapes[entry] = {}
        self._evict(keep=entry)
        return entry

    def origin(self, entry: int) -> Origin:
        """The request output ``entry`` was written for (a cached entry's)."""
        return self._origins[entry]

    def fragile(self, entry: int) -> Mapping[int, int]:
        """The positions in ``entry``'s tokens where its output is fragile, and the
        :func:`~worker.engine.proposers.confidence.fragility` of each."""
        return self._fragile[entry]

    def shapes(self, entry: int) -> Mapping[int, Shape]:
        """The positions in ``entry``'s tokens of its near-ties whose verify had the decode to
        itself, and the :data:`~worker.engine.proposers.repeat_shape.Shape` of that verify."""
        return self._shapes[entry]

    def extend(self, entry: int, tokens: Sequence[int], margins: Sequence[float] = (),
               rows: int | None = None) -> None:
        """Append generated ``tokens`` to output ``entry`` (ignored once it was evicted), with
        the target's margin for each where known (the prompt's lead-in has none). ``rows``:
        the tokens are a verify's committed ones, chosen by its rows from the first on, and
        the verify had the decode to itself with ``rows`` rows (None: it shared it)."""
        index = self._entries.get(entry)
        if index is None:
            return
        fragile, shapes = self._fragile[entry], self._shapes[entry]
        for i, margin in enumerate(margins):
            if level := fragility(margin):
                fragile[len(index) + i] = level
                if level == NEAR_TIE and rows is not None:
                    shapes[len(index) + i] = (i, rows)
        index.append(tokens)  # indexed when looked up (holding)
        size = index.nbytes() + BYTES_PER_FRAGILE * (len(fragile) + len(shapes))
        self._total += size - self._bytes[entry]
        self._bytes[entry] = size
        self._entries.move_to_end(entry)
        if self._bytes[entry] > self.max_bytes:
            self._drop(entry)  # alone larger than the whole cache: not worth keeping
            log.info("output_cache.too_large", bound_bytes=self.max_bytes)
        self._evict(keep=entry)

    def others(self, entry: int | None) -> Iterator[tuple[int, TokenIndex]]:
        """Every cached output except ``entry``, most recently used first."""
        for key in list(reversed(self._entries)):  # the caller may touch() while iterating
            index = self._entries.get(key)
            if key != entry and index is not None:
                yield key, index

    def holding(self, order: int, key: int,
                entry: int | None) -> list[tuple[int, TokenIndex]]:
        """Every cached output except ``entry`` in which the context of hash ``key`` and
        length ``ORDERS[order]`` occurred (with a follower), most recently used first. One
        table probe per output, in native code (``token_index.holding``): the drafter then
        builds occurrence lists only where there are some (building one for every output at
        every order cost ~55 calls a draft step at eight slots)."""
        return holding(reversed(self._entries.items()), order, key, entry)

    def answers(self, entry: int | None, prompt: int) -> Iterator[tuple[int, TokenIndex]]:
        """Every cached output except ``entry`` written for a prompt of hash ``prompt``,
        most recently used first."""
        same = self._by_prompt.get(prompt, ())
        if not same or same == {entry}:
            return
        for key, index in self.others(entry):
            if key in same:
                yield key, index

    def touch(self, entry: int) -> None:
        """A draft came from ``entry``: keep it longer."""
        if entry in self._entries:
            self._entries.move_to_end(entry)

    @property
    def nbytes(self) -> int:
        return self._total

    def __len__(self) -> int:
        return len(self._entries)

    def _evict(self, keep: int) -> None:
        """Drop least recently used outputs (never ``keep``) until both bounds hold."""
        while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
            victim = next((k for k in self._entries if k != keep), None)
            if victim is None:
                return
            self._drop(victim)
            self.evictions += 1

    def _drop(self, entry: int) -> None:
        del self._entries[entry]
        self._total -= self._bytes.pop(entry)
        prompt = self._origins.pop(entry).prompt
        same = self._by_prompt[prompt]
        same.discard(entry)
        if not same:
            del self._by_prompt[prompt]
        del self._fragile[entry]
        del self._shapes[entry]
