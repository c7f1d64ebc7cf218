"""Which drafter runs: the engine's method at load time, then each request's within it.

``auto`` means "the best this model can do": MTP when the GGUF carries a NextN head, n-gram
otherwise. Asking for more than the engine was built for is an error with a message, never
a silent fallback to something else.
"""

from __future__ import annotations

from shared.protocol import SpecMethod, SpecSettings
from worker.engine.proposers.base import Proposer
from worker.engine.proposers.mtp import MtpProposer, require_mtp_head
from worker.engine.proposers.ngram import NgramProposer
from worker.engine.proposers.none import NoDraft
from worker.llm import Model


def resolve_engine_method(method: SpecMethod, model: Model) -> SpecMethod:
    """The concrete method an engine is built for; ``mtp`` on a head-less model is an error."""
    if method is SpecMethod.AUTO:
        return SpecMethod.MTP if model.has_mtp_head else SpecMethod.NGRAM
    if method is SpecMethod.MTP:
        require_mtp_head(model)
    return method


def resolve_request_method(requested: SpecMethod, engine: SpecMethod) -> SpecMethod:
    """A request may narrow the engine's method (to ``none``, or MTP to n-gram), never widen it."""
    if requested is SpecMethod.AUTO:
        return engine
    if requested is SpecMethod.NONE or requested is engine:
        return requested
    if requested is SpecMethod.NGRAM and engine is SpecMethod.MTP:
        return requested
    raise ValueError(
        f"speculative method '{requested}' is not available: this engine was loaded for "
        f"'{engine}' (restart it with --spec {requested} to serve it)"
    )


def make_proposer(method: SpecMethod, spec: SpecSettings, mtp: MtpProposer | None) -> Proposer:
    """The drafter for one generation; the MTP one is the engine's resident instance."""
    if method is SpecMethod.MTP and mtp is not None:
        return mtp
    if method is SpecMethod.NGRAM:
        return NgramProposer(spec.ngram_min, spec.ngram_max)
    return NoDraft()
