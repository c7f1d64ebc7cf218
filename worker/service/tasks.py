"""The jobs a worker runs beside generations: embeddings and the tokenizer.

Each has its own job function on the model's queues (``EMBEDDING_FUNCTION``,
``TOKENIZER_FUNCTION``), routed like a generation (the model's smallest context tier, which
every worker of it takes from), and neither takes a slot of the engine:

- A **tokenizer** job (``/tokenize``, ``/detokenize``) is answered as soon as it is taken,
  between two engine steps: llama.cpp's tokenizer, the one every prompt of this worker is
  built with, takes microseconds. A gateway holds no model file (it may run on a host without
  one, and never loads llama.cpp), and no other tokenizer splits text exactly as llama.cpp
  does for every GGUF vocabulary, so the worker answers it.
- An **embedding** job is admitted (validated, its texts tokenized as prompts are, every
  input checked against the embedding context) and joins the worker's pending embeddings.
  Each pass of the serving loop pools as many pending inputs, of every embedding job the
  worker holds, as one decode of the embedding context takes
  (:meth:`worker.engine.embedding.Embedder.embed_next`); a job whose inputs are all pooled
  ends with its vectors. While it waits it holds one of the worker's slots, so a worker
  takes no more jobs than it has slots, and the jobs it holds are batched together.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import numpy as np
import structlog

from shared.admission import embedding_refusal, outside_vocabulary
from shared.event_stream import EventWriter
from shared.protocol import (
    EmbeddingRequest,
    GenerationRequest,
    JobStatus,
    Rejection,
    Telemetry,
    TokenizerRequest,
)
from worker.service.jobs import (
    RequestRejected,
    WorkerRuntime,
    admit_request,
    begin_attempt,
    fail_attempt,
    reject_attempt,
    stand_down_if_interrupted,
)


def run_embedding(request: Any) -> None:
    """``EMBEDDING_FUNCTION``: like ``run_generation``, an identity on the queue that only
    ``specfleet worker`` runs (through :class:`EmbeddingRun`)."""
    raise RuntimeError("specfleet embedding jobs run only inside 'specfleet worker', which "
                       f"holds the model; got a request for {type(request).__name__}")


def run_tokenizer(request: Any) -> None:
    """``TOKENIZER_FUNCTION``: run by ``specfleet worker`` only (:func:`tokenize_job`)."""
    raise RuntimeError("specfleet tokenizer jobs run only inside 'specfleet worker', which "
                       f"holds the model; got a request for {type(request).__name__}")


def tokenize_job(rt: WorkerRuntime, job_id: str, request: Any) -> dict[str, Any]:
    """Run one attempt of a tokenizer job whole: its final event, as rq's result. Raises
    ``RequestRejected`` (already on its stream), or what failed (on its stream too)."""
    writer, logger = begin_attempt(rt, job_id)
    req = admit_request(rt, writer, logger, TokenizerRequest, request)
    try:
        tokens, text = _tokens_and_text(rt, writer, logger, req)
        model = rt.engine.model
        pieces = [list(model.token_bytes(t, special=True)) for t in tokens] if req.pieces else None
    except RequestRejected:
        raise
    except Exception as exc:  # llama.cpp's tokenizer failed: said on the stream, then recorded
        fail_attempt(rt, writer, logger, exc)
        raise
    final = writer.final(status=JobStatus.FINISHED, tokens=tokens, text=text,
                         worker=rt.worker_name, pieces=pieces)
    logger.info("job.finished", task="tokenizer", tokens=len(tokens))
    rt.metrics.job_finished(job_id, None, "finished")
    return final.model_dump(mode="json")


def _tokens_and_text(rt: WorkerRuntime, writer: EventWriter,
                     logger: structlog.typing.FilteringBoundLogger,
                     req: TokenizerRequest) -> tuple[list[int], str]:
    """The request's token ids and text: tokenized (text ''), or detokenized, control tokens
    written as their text (llama-server's and vLLM's detokenize write them too)."""
    model = rt.engine.model
    if req.tokens is not None:
        why = outside_vocabulary(req.tokens, model.n_vocab)
        if why is not None:
            reject_attempt(rt, writer, logger, f"tokens: {why}", Rejection.VALIDATION, "tokens")
        raw = b"".join(model.token_bytes(t, special=True) for t in req.tokens)
        return list(req.tokens), raw.decode("utf-8", errors="replace")
    if req.text is not None:
        return model.tokenize(req.text, add_special=req.add_special), ""
    from worker.engine.prompt import PromptError, build_prompt  # loads llama.cpp: worker only
    chat = GenerationRequest(model=req.model, messages=req.messages, tools=req.tools)
    try:
        return build_prompt(model, chat, rt.settings.chat_template), ""
    except PromptError as exc:  # a template that fails, a name it has no place for
        reject_attempt(rt, writer, logger, str(exc), Rejection.PROMPT, "messages")


class EmbeddingRun:
    """One attempt of an embedding job: its inputs as token ids, and the vectors pooled so
    far (each in the wire's form: little-endian float32, base64)."""

    def __init__(self, rt: WorkerRuntime, writer: EventWriter,
                 logger: structlog.typing.FilteringBoundLogger, inputs: list[list[int]]) -> None:
        self.rt = rt
        self.writer = writer
        self.log = logger
        self.inputs = inputs
        self.vectors: list[str] = []
        self._cancel = rt.cancels.begin(writer.job_id)

    @classmethod
    def open(cls, rt: WorkerRuntime, job_id: str, request: Any) -> EmbeddingRun:
        """Start an attempt: count it, say so, validate the request and tokenize its texts.
        Raises ``RequestRejected`` (already on the job's stream)."""
        writer, logger = begin_attempt(rt, job_id)
        req = admit_request(rt, writer, logger, EmbeddingRequest, request)
        embedder = rt.embedder
        if embedder is None:
            reject_attempt(rt, writer, logger, f"worker {rt.worker_name} serves no embeddings "
                           "(start its workers with --embeddings)", Rejection.REQUEST, "model")
        model = rt.engine.model
        try:  # a text as a prompt is tokenized: with its special tokens
            inputs = [model.tokenize(given) if isinstance(given, str) else list(given)
                      for given in req.input]
        except Exception as exc:  # llama.cpp's tokenizer failed: said on the stream
            fail_attempt(rt, writer, logger, exc)
            raise
        for i, tokens in enumerate(inputs):
            why = outside_vocabulary(tokens, model.n_vocab) if tokens else "the text has no tokens"
            if why is not None:
                reject_attempt(rt, writer, logger, f"input.{i}: {why}", Rejection.VALIDATION,
                               f"input.{i}")
        refusal = embedding_refusal([len(t) for t in inputs], embedder.max_tokens,
                                    f"worker {rt.worker_name}'s embedding context")
        if refusal is not None:
            field, why = refusal
            reject_attempt(rt, writer, logger, f"{field}: {why}", Rejection.CONTEXT, field)
        writer.progress("embedding", done=0, total=len(inputs), worker=rt.worker_name)
        return cls(rt, writer, logger, inputs)

    @property
    def pending(self) -> list[list[int]]:
        """The inputs not pooled yet, in order."""
        return self.inputs[len(self.vectors):]

    @property
    def done(self) -> bool:
        return len(self.vectors) == len(self.inputs)

    def pooled(self, vectors: Sequence[np.ndarray]) -> None:
        """The next inputs' vectors (in order)."""
        self.vectors += [base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
                         for v in vectors]

    def should_stop(self) -> bool:
        """Checked before each embedding decode: a cancel, a second SIGTERM, or this worker
        lost."""
        rt = self.rt
        return rt.interrupt.is_set() or rt.lost.is_set() or self._cancel.cancelled()

    def finish(self) -> dict[str, Any]:
        """The final event of a finished (or cancelled) job; rq's result (without the vectors,
        which the stream holds). Raises ``JobInterrupted`` when the worker itself stopped it."""
        rt = self.rt
        usage = Telemetry(prompt_tokens=sum(len(t) for t in self.inputs))
        if not self.done:
            stand_down_if_interrupted(rt, self.writer, self.log, None)
        status = JobStatus.FINISHED if self.done else JobStatus.CANCELLED
        final = self.writer.final(status=status, telemetry=usage, worker=rt.worker_name,
                                  embeddings=self.vectors if self.done else None)
        self.log.info("job.finished" if self.done else "job.cancelled", task="embedding",
                      inputs=len(self.inputs), tokens=usage.prompt_tokens)
        rt.metrics.job_finished(self.writer.job_id, None, str(status))
        return final.model_dump(mode="json", exclude={"embeddings"})

    def fail(self, exc: BaseException) -> None:
        fail_attempt(self.rt, self.writer, self.log, exc)

    def close(self) -> None:
        self.rt.cancels.end(self.writer.job_id)

