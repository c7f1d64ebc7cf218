"""Which drafter runs: each request's method within the one the engine loaded.

The engine's own method is resolved by its plan (:func:`worker.engine.plan.resolve_method`:
``auto`` is MTP when the GGUF carries a NextN head, n-gram otherwise). ``suffix`` and
``mtp+suffix`` need engine-wide state (measured row costs, the output cache), built once at
load by :func:`make_suffix_shared`. Asking for more than the
engine was built for is an error with a message, never a silent fallback to something else.
"""

from __future__ import annotations

from shared.protocol import SpecMethod, SpecSettings
from worker.engine.drafting.bar import DraftBar
from worker.engine.drafting.costs import RowCosts
from worker.engine.proposers.base import Proposer
from worker.engine.proposers.combined import MtpSuffixProposer
from worker.engine.proposers.head import NO_HEAD, DraftHead, Solo, Staged
from worker.engine.proposers.mtp import MtpDrafter, MtpProposer, uses_mtp
from worker.engine.proposers.ngram import NgramProposer
from worker.engine.proposers.none import NoDraft
from worker.engine.proposers.output_cache import OutputCache
from worker.engine.proposers.suffix import SuffixProposer, SuffixShared
from worker.llm import Context, ContextSpec, Model

__all__ = ["make_head", "make_proposer", "make_suffix_shared", "staged", "uses_mtp",
           "uses_suffix"]


def make_head(mtp: bool, model: Model, target: Context, spec: ContextSpec) -> DraftHead:
    """The engine's draft head: the MTP drafter when the engine was planned with one
    (``plan.mtp``), else :data:`~.head.NO_HEAD`."""
    return MtpDrafter(model, target, spec) if mtp else NO_HEAD


def staged(proposer: Proposer) -> Staged:
    """``proposer`` as the engine's step drives it: the drafters that use the head are staged
    themselves; any other (a test's oracle included) drafts alone."""
    if isinstance(proposer, MtpProposer | MtpSuffixProposer):
        return proposer
    return Solo(proposer)


def uses_suffix(method: SpecMethod) -> bool:
    """An engine loaded for ``method`` needs row costs and an output cache."""
    return method in (SpecMethod.SUFFIX, SpecMethod.MTP_SUFFIX)


def make_suffix_shared(method: SpecMethod, target: Context, cache_bytes: int, bar: DraftBar,
                       costs: RowCosts | None) -> SuffixShared | None:
    """The suffix drafters' engine-wide state, when ``method`` drafts by suffix lookup: one
    slot's row ``costs`` (from the engine's cost curve), the margins of committed tokens read
    from the ``target``'s verify rows, its vocabulary saying which tokens end a generation,
    and ``bar``, the engine's draft bar (what a draft must promise over a plain step)."""
    if not uses_suffix(method):
        return None
    if costs is None:
        raise ValueError(f"method {method} drafts by suffix lookup and needs row costs")
    return SuffixShared(costs, OutputCache(cache_bytes), margins=target.margins,
                        ends=target.model.is_eog, bar=bar)


def make_proposer(method: SpecMethod, spec: SpecSettings, mtp: Proposer | None,
                  suffix: SuffixShared | None = None) -> Proposer:
    """The drafter for one generation; ``mtp`` is the slot's view of the engine's head
    (:meth:`~.head.DraftHead.proposer`).

    A method whose engine-wide part is missing (no MTP drafter, no suffix state) is an error,
    never a silent generation without drafts."""
    if method is SpecMethod.NONE:
        return NoDraft()
    if method is SpecMethod.NGRAM:
        return NgramProposer(spec.ngram_min, spec.ngram_max)
    if method is SpecMethod.MTP and mtp is not None:
        return mtp
    if method is SpecMethod.SUFFIX and suffix is not None:
        return SuffixProposer(suffix)
    if method is SpecMethod.MTP_SUFFIX and isinstance(mtp, MtpProposer) and suffix is not None:
        return MtpSuffixProposer(mtp, SuffixProposer(suffix))
    raise ValueError(f"method '{method}' needs a part of the engine it was not loaded with "
                     "(the MTP drafter or the suffix state)")
