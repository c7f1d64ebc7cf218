"""The grammar engine's view of a model's vocabulary, built once per loaded model.

llguidance computes token masks from every token's bytes and tokenizes the bytes a grammar
forces (jump-forward) with the model's own tokenizer. Both come from the GGUF through the
llama.cpp seam (:class:`worker.llm.Model`), never from a separate tokenizer file, so the mask
describes exactly the ids the target's logits are indexed by. Control tokens get a ``0xFF``
prefix (llguidance's convention, as in its own ``llguidance.llamacpp``): no UTF-8 text holds
that byte, so no grammar can spell a turn marker. Reading 262k pieces costs about a second, so
the result is cached per :class:`~worker.llm.Model` for as long as it lives.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from weakref import WeakKeyDictionary

from llguidance import LLTokenizer, TokenizerWrapper

from worker.llm import Model

#: llguidance's marker for a token that only a template, never text, produces.
CONTROL_PREFIX = b"\xff"
#: Tokenizations remembered per model (the memo is emptied when full).
MEMO_ENTRIES = 4096


@dataclass(frozen=True, eq=False)
class GrammarVocab:
    """A model's vocabulary for llguidance: its tokenizer, the model's vocabulary size (the
    logits' width; llguidance may add a virtual end token past it), the ids that end a
    generation, which a mask allows wherever the grammar lets it end, and every token's
    piece as llguidance reads it (the number cap and the close search read the bytes).
    Compared by identity: one per loaded model, and the key of what is cached for it."""

    tokenizer: LLTokenizer
    n_vocab: int
    eog: tuple[int, ...]
    pieces: tuple[bytes, ...]


class _Pieces:
    """What llguidance's ``TokenizerWrapper`` reads: the pieces, the end token, and a
    tokenizer callable (the model's, checked to spell its text back)."""

    def __init__(self, model: Model) -> None:
        self._model = model
        pieces: list[bytes] = []
        control: list[int] = []
        eog: list[int] = []
        for token in range(model.n_vocab):
            piece = model.token_bytes(token, special=True)
            if model.is_control(token):
                piece = CONTROL_PREFIX + piece
                control.append(token)
            if model.is_eog(token):
                eog.append(token)
            pieces.append(piece)
        self.tokens: Sequence[bytes] = pieces
        self.special_token_ids: Sequence[int] = control
        self.eog = tuple(eog)
        self.eos_token_id = model.eos if model.eos is not None else (eog[0] if eog else None)
        self.bos_token_id = None
        skip = set(control)
        self._ids = {p: i for i, p in enumerate(pieces) if p and i not in skip}
        self._longest = max((len(p) for p in self._ids), default=1)
        #: Texts llguidance tokenizes recur (a schema's keys, every step's forced bytes).
        self._memo: dict[str, list[int]] = {}

    def __call__(self, text: str) -> list[int]:
        """The model's tokens of ``text``. A tokenizer that does not spell its text back
        (llama.cpp's hashing test vocabulary) would hand llguidance forced tokens other than
        the grammar's bytes; then the longest pieces that do spell it are used instead."""
        if not isinstance(text, str):  # llguidance probes with bytes: strings only, please
            raise TypeError("the tokenizer takes text")
        ids = self._memo.get(text)
        if ids is None:
            ids = self._model.tokenize(text, add_special=False)
            data = text.encode("utf-8")
            if b"".join(self.tokens[t] for t in ids) != data:
                ids = self._greedy(data)
            if len(self._memo) >= MEMO_ENTRIES:
                self._memo.clear()
            self._memo[text] = ids
        return list(ids)

    def _greedy(self, data: bytes) -> list[int]:
        out: list[int] = []
        at = 0
        while at < len(data):
            for n in range(min(self._longest, len(data) - at), 0, -1):
                token = self._ids.get(data[at:at + n])
                if token is not None:
                    out.append(token)
                    at += n
                    break
            else:  # llguidance then fails the matcher (at admission: a refusal)
                raise ValueError(f"no token of this vocabulary spells {data[at:at + 1]!r}")
        return out


_CACHE: WeakKeyDictionary[Model, GrammarVocab] = WeakKeyDictionary()
#: Constraints compile on threads of their own: the first ones of a model build its view once.
_BUILDING = threading.Lock()


def grammar_vocab(model: Model) -> GrammarVocab:
    """``model``'s vocabulary for llguidance, built on first use and kept with the model."""
    with _BUILDING:
        vocab = _CACHE.get(model)
        if vocab is None:
            pieces = _Pieces(model)
            tokenizer = LLTokenizer(TokenizerWrapper(pieces))
            vocab = _CACHE[model] = GrammarVocab(tokenizer, model.n_vocab, pieces.eog,
                                                    tuple(pieces.tokens))
        return vocab
