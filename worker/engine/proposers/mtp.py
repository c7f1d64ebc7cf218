"""MTP self-speculation: the model's own NextN head drafts from the target's hidden states.

One model, two contexts. The draft context (``ctx_type = MTP``) runs only the NextN block,
and an entry at position ``p`` is (token ``p``, the target's hidden state at ``p - 1``); its
output predicts token ``p + 1``. The draft context therefore has to be kept in step with the
target: it is fed every prompt position at :meth:`start` and, after each verify, only the
confirmed token and the accepted drafts (seed 000: the rejected tail never has to be
computed, and the draft context never has to be rolled back).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shared.logs import get_logger
from worker.engine.proposers.base import Draft, VerifyOutcome
from worker.llm import Batch, Context, ContextSpec, LlamaError, Model

log = get_logger("engine.mtp")


class MtpUnavailableError(ValueError):
    """The model cannot draft for itself (no NextN head, or not loaded with it)."""


def require_mtp_head(model: Model) -> None:
    """Refuse MTP on a GGUF without a NextN head, naming the methods that do work for it."""
    if not model.has_mtp_head:
        raise MtpUnavailableError(
            f"{model.spec.path} has no MTP (NextN) head (nextn_predict_layers = 0): "
            "use spec method 'ngram' or 'auto'"
        )


class MtpProposer:
    """Drafts with the NextN head; owns the draft context for the engine's lifetime."""

    name = "mtp"

    def __init__(self, model: Model, target: Context, spec: ContextSpec) -> None:
        require_mtp_head(model)
        if not model.spec.load_mtp:
            raise MtpUnavailableError("the MTP drafter needs the model loaded with load_mtp=True")
        self._target = target
        target.expose_hidden(masked=False)
        self._draft = Context(model, spec)
        self._draft.expose_hidden(masked=True)
        self._batch = Batch(spec.n_batch, model.n_embd)
        #: Target hidden state of the position before the next token to feed.
        self._pending = np.zeros(model.n_embd, dtype=np.float32)
        #: Positions ``[0, _fed)`` of the draft KV hold entries conditioned on the target.
        self._fed = 0

    def start(self, prompt: Sequence[int]) -> None:
        """Feed every prompt position the target has decoded (all but the last token)."""
        self._draft.clear()
        self._pending[:] = 0.0
        self._fed = 0
        n = len(prompt) - 1
        if n:
            self._feed(prompt[:n], 0, self._target.hidden_rows(n))

    def propose(self, history: Sequence[int], width: int, p_min: float) -> Draft:
        """Chain the head: (last, target hidden) -> d1, (d1, head's own hidden) -> d2, ...

        Only the first entry is conditioned on the target; the later ones are the head's own
        guesses, so they are trimmed from the draft KV afterwards.
        """
        pos = len(history) - 1
        token = history[-1]
        hidden = self._pending
        tokens: list[int] = []
        decoded = 0
        for i in range(width):
            try:
                self._draft.decode(self._batch.set([token], pos + i, True, hidden[None, :]))
            except LlamaError as exc:
                log.warning("mtp.draft_failed", pos=pos + i, error=str(exc))
                break
            decoded += 1
            logits = self._draft.logits(0)
            token = int(np.argmax(logits))
            if p_min > 0 and _top_probability(logits, token) < p_min:
                break
            tokens.append(token)
            hidden = self._draft.hidden(0)
        if decoded:
            self._fed = pos + 1
            if not self._draft.seq_rm(self._fed):
                raise LlamaError(f"could not trim the MTP draft context at position {self._fed}")
        return Draft(tokens)

    def observe(self, outcome: VerifyOutcome) -> None:
        """Catch up on ``[last, accepted drafts]`` with the target's hidden rows of the verify."""
        n = outcome.n_accepted + 1
        rows = self._target.hidden_rows(len(outcome.draft) + 1)[:n]
        self._feed([outcome.last_token, *outcome.accepted], outcome.pos0, rows)

    def close(self) -> None:
        self._batch.close()
        self._draft.close()

    def _feed(self, tokens: Sequence[int], pos0: int, rows: np.ndarray) -> None:
        """Feed ``tokens`` (at ``pos0..``) whose target hidden rows are ``rows``: entry i gets
        the hidden state of the position before it. Entries already fed are skipped."""
        inputs = np.concatenate([self._pending[None, :], rows[:-1]])
        step = self._batch.capacity
        for start in range(self._fed - pos0, len(tokens), step):
            end = min(start + step, len(tokens))
            self._draft.decode(self._batch.set(tokens[start:end], pos0 + start, False,
                                               inputs[start:end]))
        self._fed = pos0 + len(tokens)
        self._pending[:] = rows[-1]


def _top_probability(logits: np.ndarray, top: int) -> float:
    """Softmax probability of the argmax ``top`` (the head's confidence in its draft)."""
    return float(1.0 / np.exp(logits - logits[top]).sum())
