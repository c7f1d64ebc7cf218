"""Prefix-affinity routing at submit: send a request to the worker that already holds its
prefix, when that worker has a free slot; otherwise to the model's shared queues as before.

Workers publish the digests of what their slots hold and how many slots are generating
(``Keys.prefix_blocks``, written by ``worker/service/prefix_presence.py``;
``shared/prefix_digest.py`` defines the digests). A submit asks every candidate in one
pipelined round trip: ``HMGET`` of its busy count and the request's block digests (how many
leading blocks it holds) and the lengths of its own queues (jobs routed to it, not yet
taken): its load right now, where the registry's ``current_jobs`` is a heartbeat old. The
deepest holder with a free slot wins (ties: the most free slots); nobody holding a whole
block, or every holder saturated, means the shared queues, so no request waits behind a busy
holder.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis import Redis
from rq.queue import Queue

from shared.keys import Keys
from shared.prefix_digest import BUSY_FIELD, leading_depth, request_digests
from shared.protocol import GenerationRequest, Priority, WorkerInfo


@dataclass(frozen=True)
class Route:
    """The worker a request goes to: how deep its prefix is held there, its free slots."""

    worker: str
    n_ctx: int
    depth_blocks: int
    free_slots: int


def choose_holder(connection: Redis, keys: Keys, request: GenerationRequest,
                  workers: list[WorkerInfo], tier: int | None) -> Route | None:
    """The worker to route ``request`` to, or None for the shared queues.

    Candidates are the live workers that reuse prefixes, listen to the request's context
    ``tier`` (their per-slot context holds it) and can render it (a chat needs a template);
    a request that opted out of the prefix cache is never routed."""
    if not request.prefix_cache:
        return None
    candidates = [w for w in workers if w.prefix_cache
                  and (tier is None or w.n_ctx >= tier)
                  and (request.messages is None or w.chat_template)]
    digests = request_digests(request)
    if not candidates or not digests:
        return None
    prefix = Queue.redis_queue_namespace_prefix
    with connection.pipeline(transaction=False) as pipe:
        for w in candidates:
            pipe.hmget(keys.prefix_blocks(request.model, w.name), [BUSY_FIELD, *digests])
            for priority in (Priority.HIGH, Priority.NORMAL):
                pipe.llen(prefix + keys.own_queue(request.model, w.name, priority))
        replies = pipe.execute()
    best: Route | None = None
    for i, w in enumerate(candidates):
        (busy, *found), *waiting = replies[3 * i:3 * i + 3]
        route = Route(worker=w.name, n_ctx=w.n_ctx,
                      depth_blocks=leading_depth([hit is not None for hit in found]),
                      free_slots=w.slots - int(busy or 0) - sum(int(n) for n in waiting))
        if route.depth_blocks and route.free_slots > 0 and (
                best is None
                or (route.depth_blocks, route.free_slots) > (best.depth_blocks, best.free_slots)):
            best = route
    return best
