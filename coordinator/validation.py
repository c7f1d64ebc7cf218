"""Admission checks at submit: every rejection is a clear error before anything is queued.

Token counting is honest without a tokenizer: ``prompt_tokens`` are counted exactly; a text
prompt has at least one token and at most (UTF-8 bytes + 2) tokens (every token consumes at
least one byte; +2 for BOS/EOS specials). A text prompt is rejected here only when even one
token cannot fit; when only the upper bound overflows, the worker counts exactly after
tokenizing and fails the job with a ``context`` error before generating anything.

A request's ``constraint`` is compiled here without a vocabulary (llguidance,
``shared.constraint.check_constraint``): a schema or grammar that cannot compile is refused
naming the problem, so every path that queues (the client, the CLI, batches, the gateway)
refuses it before a worker could.

Whether the request's model can be served at all is :class:`coordinator.models.ModelDirectory`'s
rule (served, coming, known, unknown); :func:`check_admission` turns its answer into the
refusal each caller maps (a coming model's ``coming`` is the one a caller may wait out).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from coordinator.models import ModelState, Standing
from shared.admission import (
    context_refusal,
    embedding_refusal,
    outside_vocabulary,
    vocabulary_refusal,
)
from shared.capacity import CapacityError, within_capacity
from shared.constraint import ConstraintError, check_constraint
from shared.protocol import (
    EmbeddingRequest,
    GenerationRequest,
    TokenizerRequest,
    WorkerInfo,
    describe_validation_error,
)

#: A job that is no generation: an embedding or a tokenization (``worker/service/tasks.py``).
Task = EmbeddingRequest | TokenizerRequest


class SubmitError(ValueError):
    """A request the coordinator refuses to queue; the message says what and why.

    ``reason`` names the kind of refusal for callers that map it (the HTTP gateway's status
    codes): ``invalid``, ``context_length_exceeded``, ``unknown_model``, ``no_worker`` (known,
    nothing live or coming), ``coming`` (no live worker yet, one is awaited: a caller may
    wait, ``coordinator.waiting``), ``wait_timeout`` (one was awaited past the deadline);
    ``param`` the request field at fault, where one is; ``model`` the model refused (an
    alias resolved), where the refusal is about it."""

    def __init__(self, message: str, reason: str = "invalid",
                 param: str | None = None, model: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.param = param
        self.model = model


def parse_request(request: GenerationRequest | dict[str, Any]) -> GenerationRequest:
    """The request as a validated model with a constraint that compiles, or a
    ``SubmitError`` naming every bad field."""
    if not isinstance(request, GenerationRequest):
        if not isinstance(request, dict):
            raise SubmitError(f"a request must be a JSON object, not {type(request).__name__}")
        try:
            request = GenerationRequest.model_validate(request)
        except ValidationError as exc:
            errors = exc.errors()
            param = ".".join(str(p) for p in errors[0]["loc"]) if errors else None
            raise SubmitError(f"invalid request: {describe_validation_error(exc)}",
                              param=param or None) from None
    if request.constraint is not None:
        try:
            check_constraint(request.constraint)
        except ConstraintError as exc:
            raise SubmitError(f"constraint: {exc}", param="constraint") from None
    return request


def prompt_token_bounds(request: GenerationRequest) -> tuple[int, int]:
    """Lowest and highest number of tokens the prompt can have."""
    if request.prompt_tokens is not None:
        return len(request.prompt_tokens), len(request.prompt_tokens)
    return 1, len((request.prompt or "").encode("utf-8")) + 2


def check_admission(request: GenerationRequest, state: ModelState,
                    known_models: Callable[[], list[str]], require_live_worker: bool) -> None:
    """Raise ``SubmitError`` when the request cannot be served by the fleet as ``state``
    (its model's, ``ModelDirectory.state``) stands.

    ``known_models`` is only asked for an unknown model's message. A coming model's requests
    are refused ``coming`` (the caller may wait for a worker) unless they surely exceed its
    declared contexts; with ``require_live_worker`` off, a model known or coming queues."""
    if state.standing is Standing.COMING:
        _check_declared_context(request, state)
    if not served(request.model, state, known_models, require_live_worker):
        return
    workers = state.workers
    if request.messages is not None and not any(w.chat_template for w in workers):
        raise SubmitError(f"model '{request.model}' has no chat template: send a prompt, or "
                          "start its workers with SPECFLEET_CHAT_TEMPLATE", param="messages")
    _check_names(request, workers)
    check_vocabulary(request, workers)
    for w in workers:  # any live worker of the model may take the job, so each must serve it
        if w.capacity is not None:
            try:
                within_capacity(request.speculative, w.capacity)
            except CapacityError as exc:
                raise SubmitError(f"speculative: {exc} (worker {w.name} of model "
                                  f"'{request.model}')", param="speculative") from None
    _check_context(request, max(w.n_ctx for w in workers),
                   f"the largest context of model '{request.model}' workers")


def served(model: str, state: ModelState, known_models: Callable[[], list[str]],
           require_live_worker: bool) -> bool:
    """Whether ``model`` (as ``state`` stands) has live workers to check a request against.
    An unknown model is refused; a known or coming one without a live worker is refused
    (``no_worker``; ``coming``, which a caller may wait out) unless ``require_live_worker``
    is off: then False, and the request queues unchecked."""
    if state.standing is Standing.UNKNOWN:
        known = ", ".join(known_models()) or "none"
        raise SubmitError(f"unknown model '{model}' (known models: {known}; declare one with "
                          "specfleet models add)", "unknown_model", param="model", model=model)
    if state.standing is Standing.COMING:
        if require_live_worker:
            raise SubmitError(f"no live worker serves model '{model}' yet ({state.why_coming()})",
                              "coming", param="model", model=model)
        return False
    if state.standing is Standing.KNOWN:
        if require_live_worker:
            raise SubmitError(f"no live worker serves model '{model}' "
                              "(start one, or set SPECFLEET_REQUIRE_LIVE_WORKER=false to queue)",
                              "no_worker", param="model", model=model)
        return False
    return True


def check_task_admission(request: Task, state: ModelState,
                         known_models: Callable[[], list[str]], require_live_worker: bool) -> None:
    """:func:`check_admission`'s rule for a task: the model is served (:func:`served`), and
    every live worker of it can run the task (any of them may take it): an embedding's
    workers serve embeddings, with every token-id input in their vocabularies and embedding
    contexts (a text is tokenized and checked by its worker); a chat to tokenize has a
    template; token ids to detokenize are in the vocabulary."""
    if not served(request.model, state, known_models, require_live_worker):
        return
    workers = state.workers
    if isinstance(request, EmbeddingRequest):
        _check_embedding(request, workers)
        return
    if request.messages is not None:
        if not any(w.chat_template for w in workers):
            raise SubmitError(f"model '{request.model}' has no chat template: send text, or "
                              "start its workers with SPECFLEET_CHAT_TEMPLATE", param="messages")
        _check_names(request, workers)
    _check_ids("tokens", request.tokens or [], request.model, workers)


def _check_embedding(request: EmbeddingRequest, workers: list[WorkerInfo]) -> None:
    blind = next((w for w in workers if w.embedding_tokens is None), None)
    if blind is not None:
        raise SubmitError(f"worker {blind.name} of model '{request.model}' serves no "
                          "embeddings (start the model's workers with --embeddings)",
                          param="model")
    for i, given in enumerate(request.input):
        if isinstance(given, list):
            _check_ids(f"input.{i}", given, request.model, workers)
    most = min(w.embedding_tokens or 0 for w in workers)
    refusal = embedding_refusal(
        [len(given) if isinstance(given, list) else None for given in request.input], most,
        f"the smallest embedding context of model '{request.model}' workers")
    if refusal is not None:
        field, why = refusal
        raise SubmitError(f"{field}: {why}", "context_length_exceeded", param=field)


def _check_ids(field: str, ids: list[int], model: str, workers: list[WorkerInfo]) -> None:
    """Token ids of a task's ``field`` in the smallest vocabulary of the workers that publish
    theirs."""
    sizes = [w.n_vocab for w in workers if w.n_vocab is not None]
    why = outside_vocabulary(ids, min(sizes)) if sizes else None
    if why is not None:
        raise SubmitError(f"{field}: {why} of model '{model}'", param=field)


def task_tier(workers: list[WorkerInfo]) -> int | None:
    """The context tier a task queues on: the smallest per-slot context of a live worker,
    which every worker of the model takes from (a task holds no context of a slot). None
    (the untiered queue) when no worker is live."""
    return min((w.n_ctx for w in workers), default=None)


def _check_context(request: GenerationRequest, n_ctx: int, whose: str) -> None:
    lowest, _ = prompt_token_bounds(request)
    why = context_refusal(lowest, request.max_tokens, n_ctx, whose,
                          counted=request.prompt_tokens is not None)
    if why is not None:
        raise SubmitError(why, "context_length_exceeded", param="max_tokens")


def _check_names(request: GenerationRequest | TokenizerRequest,
                 workers: list[WorkerInfo]) -> None:
    """A message's ``name`` only where every live worker's template renders it (any of them
    may take the job): elsewhere it would be dropped."""
    named = next((i for i, m in enumerate(request.messages or []) if m.name is not None), None)
    if named is None:
        return
    blind = next((w for w in workers if not w.chat_template_names), None)
    if blind is not None:
        param = f"messages.{named}.name"
        raise SubmitError(f"{param}: the chat template of model '{request.model}' (worker "
                          f"{blind.name}: {blind.chat_template_source}) has no place for a "
                          "message's name (put it in the content)", param=param)


def _check_declared_context(request: GenerationRequest, state: ModelState) -> None:
    """A request that surely exceeds every context a coming model's workers are declared
    with is refused now, not after its wait."""
    if state.entry is None or not state.entry.contexts:
        return
    _check_context(request, max(state.entry.contexts),
                   f"the largest context declared for model '{request.model}'")


def check_vocabulary(request: GenerationRequest, workers: list[WorkerInfo]) -> None:
    """Token ids (``prompt_tokens``, ``sampling.logit_bias``) must exist in the vocabulary
    of every live worker of the model (any of them may take the job); workers that do not
    publish their vocabulary size are not asked."""
    sizes = [w.n_vocab for w in workers if w.n_vocab is not None]
    if not sizes:
        return
    refusal = vocabulary_refusal(request, min(sizes))
    if refusal is not None:
        field, why = refusal
        raise SubmitError(f"{field}: {why} of model '{request.model}'", param=field)


def choose_tier(request: GenerationRequest, workers: list[WorkerInfo]) -> int | None:
    """The context tier to queue ``request`` on (``Keys.queue(ctx=...)``): the smallest
    per-slot context of a live worker that surely holds prompt + ``max_tokens``, so only
    workers that can run it take it (the others never listen to that tier). A text prompt
    whose exact length only a worker can count, and that may not fit even the largest for
    sure, goes to the largest tier: its worker counts exactly and refuses it if it must.
    None (the model's untiered queue) when no worker is live."""
    contexts = sorted({w.n_ctx for w in workers})
    if not contexts:
        return None
    _, highest = prompt_token_bounds(request)
    return next((c for c in contexts if highest + request.max_tokens <= c), contexts[-1])
