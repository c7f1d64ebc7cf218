"""What a worker can do (its capacity, fixed at load) against what a request asks of it.

A worker is loaded for one drafting method, a draft width N and a rollback depth D: they size
its contexts and its recurrent memory, so no request can change them. A request may only
*narrow* them: a method the loaded one also serves (:data:`SERVES`), a smaller ``draft_max``;
its ``rollback_depth``, when given, must be the worker's own. A field the request does not set
means "the worker's". :func:`within_capacity` applies the rule, once on each side of the
wire: the coordinator at submit against the live workers' published capacity, the engine at
admission (a request that bypassed the coordinator, or an in-process one): a request asking
for what its worker cannot do is refused with the reason, never served with a silent
substitute.
"""

from __future__ import annotations

from shared.protocol import SpecMethod, SpecSettings, WorkerCapacity

#: What a request may ask of an engine loaded for each method (narrowing, never widening).
SERVES: dict[SpecMethod, tuple[SpecMethod, ...]] = {
    SpecMethod.NONE: (SpecMethod.NONE,),
    SpecMethod.NGRAM: (SpecMethod.NGRAM, SpecMethod.NONE),
    SpecMethod.SUFFIX: (SpecMethod.SUFFIX, SpecMethod.NGRAM, SpecMethod.NONE),
    SpecMethod.MTP: (SpecMethod.MTP, SpecMethod.NGRAM, SpecMethod.NONE),
    SpecMethod.MTP_SUFFIX: (SpecMethod.MTP_SUFFIX, SpecMethod.MTP, SpecMethod.SUFFIX,
                            SpecMethod.NGRAM, SpecMethod.NONE),
}


class CapacityError(ValueError):
    """A request asks for what its worker cannot do; the message says which field and why."""


def _narrow_method(requested: SpecMethod, loaded: SpecMethod) -> SpecMethod:
    if requested is SpecMethod.AUTO:
        return loaded
    if requested in SERVES[loaded]:
        return requested
    raise CapacityError(
        f"speculative method '{requested}' is not available: the worker was loaded for "
        f"'{loaded}' (start one with --spec {requested} to serve it)")


def within_capacity(spec: SpecSettings, capacity: WorkerCapacity) -> SpecSettings:
    """The settings a worker of ``capacity`` runs ``spec`` with: its method resolved (``auto``
    is the worker's) and every field it left unset taken from the worker. Raises
    :class:`CapacityError` when a field the request set would widen the capacity.

    The one walk of a request's settings against a capacity: the coordinator makes it at
    submit for every live worker of the model, the engine once more at admission."""
    given = spec.model_fields_set
    method = _narrow_method(spec.method, capacity.method)
    if "draft_max" in given and spec.draft_max > capacity.draft_max:
        raise CapacityError(f"draft_max {spec.draft_max} exceeds the worker's draft width "
                            f"{capacity.draft_max}, fixed when it loaded (--draft-max)")
    if "rollback_depth" in given and spec.rollback_depth is not None:
        if capacity.rollback_depth is None:
            raise CapacityError("rollback_depth does not apply: the model is not recurrent "
                                "(rejected drafts are trimmed from the KV cache)")
        if spec.rollback_depth != capacity.rollback_depth:
            raise CapacityError(f"rollback_depth {spec.rollback_depth} is not the worker's "
                                f"{capacity.rollback_depth}: it is fixed when a worker loads "
                                "(--rollback-depth); omit it, or start a worker with that depth")
    filled = {"draft_max": capacity.draft_max, "rollback_depth": capacity.rollback_depth}
    return spec.model_copy(update={"method": method,
                                   **{k: v for k, v in filled.items() if k not in given}})
