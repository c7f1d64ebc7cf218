"""What this worker's slots hold, published in Redis for prefix-affinity routing at submit.

The engine keeps each slot's sequence as a prefix-cache entry when its generation ends
(``worker/engine/prefix_cache.py``), and places the next request in the free slot sharing the
longest prefix with it. Here each slot's entry is described by the block digests of its
request's canonical text (``shared/prefix_digest.py``): the prompt when the slot admits it,
prompt + generated text once it ends (cancelled and interrupted runs leave theirs too, as the
engine does). The union over slots, and the count of slots taken (generating, or held by a
job not in the engine: a constraint compiling, an embedding job), are rewritten as one Redis
hash (``Keys.prefix_blocks``: a field per digest, and :data:`BUSY_FIELD`) in one transaction
at each change, with the registration's TTL, which the heartbeat refreshes, so a dead
worker's set expires with its registration (recovery deletes it at once). A request
that opted out of the prefix cache leaves nothing behind, and a worker started with
``--prefix-cache off`` publishes nothing: both match what the engine keeps.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from redis import Redis
from redis.typing import EncodableT, FieldT

from shared.keys import Keys
from shared.prefix_digest import BUSY_FIELD, block_digests, canonical_text, continued
from shared.protocol import GenerationRequest


class PrefixPresence:
    """The published digests of what each slot (by sequence id) caches, and how many slots
    are taken (``busy``: routing's load figure, exact at each admission and ending, where the
    in-flight list still holds a job whose final event is out): the generating ones and
    those :meth:`holding` counts, each of which a routed generation would wait behind."""

    def __init__(self, connection: Redis, keys: Keys, model: str, worker: str,
                 ttl_seconds: float, enabled: bool) -> None:
        self._conn = connection
        self._key = keys.prefix_blocks(model, worker)
        self._ttl_ms = max(1, int(ttl_seconds * 1000))
        self.enabled = enabled
        self._slots: dict[int, list[str]] = {}
        self._busy: set[int] = set()
        self._held = 0

    def admitted(self, seq: int, request: GenerationRequest) -> None:
        """Slot ``seq`` now computes ``request``'s prompt (its previous entry is replaced)."""
        self._busy.add(seq)
        self._set(seq, block_digests(canonical_text(request)) if request.prefix_cache else [])

    def ended(self, seq: int, request: GenerationRequest, text: str,
              tokens: Sequence[int]) -> None:
        """Slot ``seq``'s generation ended with ``text``/``tokens``: it holds both, and is
        free for the next request."""
        self._busy.discard(seq)
        self._set(seq, block_digests(continued(request, text, tokens))
                  if request.prefix_cache else [])

    def dropped(self, seqs: Iterable[int]) -> None:
        """These slots stopped and hold nothing reusable any more (the engine cleared them)."""
        for seq in seqs:
            self._busy.discard(seq)
            self._slots.pop(seq, None)
        self._publish()

    def holding(self, jobs: int) -> None:
        """``jobs`` slots are held by jobs outside the engine's slots (a constraint compiling,
        an embedding job: ``ServingLoop._free_slots`` counts them); published when it
        changes."""
        if jobs != self._held:
            self._held = jobs
            self._publish()

    def refresh(self) -> None:
        """Extend the hash's life by one registration TTL (each heartbeat)."""
        if self.enabled:
            self._conn.pexpire(self._key, self._ttl_ms)

    def _set(self, seq: int, digests: list[str]) -> None:
        if digests:
            self._slots[seq] = digests
        else:
            self._slots.pop(seq, None)
        self._publish()

    def _publish(self) -> None:
        if not self.enabled:
            return
        fields: dict[FieldT, EncodableT] = dict.fromkeys(set().union(*self._slots.values()), 1)
        fields[BUSY_FIELD] = len(self._busy) + self._held
        with self._conn.pipeline(transaction=True) as pipe:
            pipe.delete(self._key)
            pipe.hset(self._key, mapping=fields)
            pipe.pexpire(self._key, self._ttl_ms)
            pipe.execute()
