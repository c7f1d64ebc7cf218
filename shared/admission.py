"""Whether a request fits a worker: its token ids in the vocabulary, prompt + ``max_tokens`` in
the context, an embedding's inputs in the embedding context. Decided here once, for both
sides of the wire.

The coordinator asks at submit against what the live workers publish (their smallest
vocabulary, their largest context, with the prompt's length bounded when only a worker can
count it); the worker asks again at admission against its own model, with the prompt counted
(a request may have bypassed the coordinator, or been queued before a worker with a smaller
context took it); the engine asks of the token ids of an in-process caller. Each side wraps
the answer in its own error (a 400 naming the field, a ``Rejection``, a ``ValueError``), but
the rule and its message are these.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from shared.protocol import MAX_EMBEDDING_TOKENS, SamplingParams

#: Ids named in a refusal, at most (a prompt of garbage would otherwise fill the message).
SHOWN_IDS = 5


def outside_vocabulary(ids: Iterable[int], n_vocab: int) -> str | None:
    """Why ``ids`` do not fit a vocabulary of ``n_vocab`` (None: they do): llama.cpp would
    read past its embedding table."""
    outside = sorted({t for t in ids if not 0 <= t < n_vocab})
    if not outside:
        return None
    shown = ", ".join(str(t) for t in outside[:SHOWN_IDS])
    return f"token id(s) {shown} outside the vocabulary (ids 0..{n_vocab - 1})"


class HoldsTokenIds(Protocol):
    """What carries token ids that must fit a vocabulary: a queued request
    (:class:`~shared.protocol.GenerationRequest`) or an engine's own slot request."""

    @property
    def prompt_tokens(self) -> Sequence[int] | None: ...

    @property
    def sampling(self) -> SamplingParams: ...


def vocabulary_refusal(request: HoldsTokenIds, n_vocab: int) -> tuple[str, str] | None:
    """The first of the request's token-id fields (``prompt_tokens``, ``sampling.logit_bias``)
    that does not fit ``n_vocab``, and why; None when both do."""
    for field, ids in (("prompt_tokens", request.prompt_tokens or []),
                       ("sampling.logit_bias", request.sampling.logit_bias)):
        why = outside_vocabulary(ids, n_vocab)
        if why is not None:
            return field, why
    return None


def context_refusal(prompt_tokens: int, max_tokens: int, n_ctx: int, whose: str, *,
                    counted: bool = True) -> str | None:
    """Why a prompt of ``prompt_tokens`` plus ``max_tokens`` does not fit ``whose`` context of
    ``n_ctx`` (None: it does). ``counted`` False: ``prompt_tokens`` is only a lower bound (a
    text prompt the coordinator cannot tokenize)."""
    if prompt_tokens + max_tokens <= n_ctx:
        return None
    tokens = f"{prompt_tokens} token{'' if prompt_tokens == 1 else 's'}"
    what = f"prompt ({tokens})" if counted else f"prompt (at least {tokens})"
    return f"{what} + max_tokens ({max_tokens}) exceeds {whose} ({n_ctx} tokens)"


def embedding_refusal(lengths: Sequence[int | None], most: int,
                      whose: str) -> tuple[str, str] | None:
    """The first input of an embedding (``input.N``) too long for ``whose`` embedding context
    of ``most`` tokens, or the whole ``input`` past :data:`MAX_EMBEDDING_TOKENS`, and why;
    None when they fit. ``lengths`` are the inputs' token counts (None: not counted yet, a text
    only a worker can tokenize)."""
    for i, n in enumerate(lengths):
        if n is not None and n > most:
            return f"input.{i}", f"{n} tokens, too large for {whose} ({most} tokens)"
    total = sum(n for n in lengths if n is not None)
    if total > MAX_EMBEDDING_TOKENS:
        return "input", (f"{total} tokens in all, too large for one request (at most "
                         f"{MAX_EMBEDDING_TOKENS})")
    return None
