"""How far a grammar is from a valid end, and which tokens lead there: the close a
constrained slot steers to when ``max_tokens`` would otherwise cut its output
(docs/structured.md, "Closing within max_tokens").

llguidance answers what may come next, not how soon the grammar can end, so this module
searches for it from wherever the matcher stands: the grammar's forced run when it has one
(llguidance's fast-forward tokens, already the model's own spelling), else one byte chosen
by a fixed preference (:class:`Closer`), until the matcher accepts. The preference is
JSON's shape: inside a string its closing quote first; outside, ``}`` and ``]`` before
``,`` (what goes on to the next required item) before ``"`` (what opens one) before ``0``
(the shortest number), then every other one-byte token in byte order; only where no
one-byte token is allowed is a full mask computed and its shortest token taken. Whether a
quote would open or close a string is known where the output is JSON (the number cap
follows its strings, :mod:`.numbers`); elsewhere the quote comes first, since a string a
quote opens ends at the next one, where a comma would go on inside it. The bytes found are
then spelled again by the model's tokenizer (``"}`` is one token on Gemma, not two), and
the shorter spelling that the matcher accepts is the plan.

This is the shortest close *this search* finds, not a proven minimum (an ``integer`` with
``minimum: 5`` closes as ``10``, not ``5``); what the budget logic needs is a close that
exists and whose length it knows, and a plan's tail is a close of the state after its
first token, so steering along one never needs a longer one.
"""

from __future__ import annotations

import threading
from weakref import WeakKeyDictionary

import numpy as np
from llguidance import LLMatcher

from worker.engine.constraint.numbers import NumberCap
from worker.engine.constraint.tokenizer import GrammarVocab

#: Bytes tried first at a choice outside a JSON string, in order; inside one, or where the
#: output is not JSON: ``"`` first.
OUTSIDE = b'}],"0'
INSIDE = b'"}],0'
#: The longest close a search follows before it gives up (tokens).
SEARCH_LIMIT = 4096


class Closer:
    """One vocabulary's one-byte tokens in the orders the search tries them."""

    def __init__(self, vocab: GrammarVocab) -> None:
        single: dict[int, int] = {}
        eog = set(vocab.eog)
        for token, piece in enumerate(vocab.pieces[: vocab.n_vocab]):
            if len(piece) == 1 and token not in eog and piece[0] not in single:
                single[piece[0]] = token
        rest = [single[b] for b in sorted(single) if b not in OUTSIDE]
        self.outside = [single[b] for b in OUTSIDE if b in single] + rest
        self.inside = [single[b] for b in INSIDE if b in single] + rest
        self._vocab = vocab
        self._lengths = np.array([len(p) if p else np.iinfo(np.int32).max
                                  for p in vocab.pieces[: vocab.n_vocab]], dtype=np.int32)
        self._lengths[list(eog)] = np.iinfo(np.int32).max

    def choice(self, matcher: LLMatcher, cap: NumberCap | None, state: int) -> int | None:
        """The token the search takes where nothing is forced: the first one-byte token of
        the preference (outside or inside a string: ``cap``'s ``state`` says, None: inside)
        that the grammar and the cap allow, else the shortest allowed token (None: the
        grammar allows no token but an end, which is not a close)."""
        inside = cap is None or cap.in_string(state)
        for token in self.inside if inside else self.outside:
            if (matcher.validate_tokens([token]) == 1
                    and (cap is None or not cap.step(state, token)[1])):
                return token
        words = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(words, bitorder="little")[: self._vocab.n_vocab].view(np.bool_)
        if cap is not None:
            bits = bits & ~cap.forbidden(state)
        lengths = np.where(bits, self._lengths, np.iinfo(np.int32).max)
        token = int(np.argmin(lengths))
        return token if lengths[token] != np.iinfo(np.int32).max else None

    def respell(self, tokens: list[int]) -> list[int]:
        """``tokens``' bytes as the model's tokenizer spells them (``tokens`` when they are
        not whole UTF-8 text)."""
        return self._spell(b"".join(self._vocab.pieces[t] for t in tokens)) or tokens

    def after(self, plan: list[int], token: int) -> list[int] | None:
        """What is left of ``plan``'s bytes once ``token`` wrote their start, spelled by the
        model's tokenizer (a model that writes a close its own way: ``"`` then ``}`` where
        the plan says ``"}``); None when ``token`` does not start them."""
        data = b"".join(self._vocab.pieces[t] for t in plan)
        piece = self._vocab.pieces[token]
        if not piece or not data.startswith(piece):
            return None
        rest = data[len(piece):]
        return self._spell(rest) if rest else []

    def _spell(self, data: bytes) -> list[int] | None:
        """``data`` as the model's tokenizer spells it (None: not whole UTF-8 text)."""
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return None
        return list(self._vocab.tokenizer.tokenize_str(text))


_CLOSERS: WeakKeyDictionary[GrammarVocab, Closer] = WeakKeyDictionary()
_LOCK = threading.Lock()


def closer(vocab: GrammarVocab) -> Closer:
    """``vocab``'s :class:`Closer`, built once per vocabulary."""
    with _LOCK:
        found = _CLOSERS.get(vocab)
        if found is None:
            found = _CLOSERS[vocab] = Closer(vocab)
        return found


def close_plan(matcher: LLMatcher, vocab: GrammarVocab, limit: int,
               cap: NumberCap | None = None, state: int = 0) -> list[int] | None:
    """The tokens of a close from where ``matcher`` stands ([] where it may end now), at most
    ``limit`` of them, or None when the search finds none that short. ``cap`` and its
    ``state`` there (the output's JSON, :mod:`.numbers`): which preference applies (inside a
    string or not), and no step runs a number past the cap. The matcher is left where it
    stood."""
    search = closer(vocab)
    eog = set(vocab.eog)
    taken: list[int] = []
    try:
        while not matcher.is_accepting():
            if len(taken) >= limit or matcher.is_error():
                return None
            forced = matcher.compute_ff_tokens()
            end = next((i for i, t in enumerate(forced) if t in eog), len(forced))
            step = forced[:end]
            if not step:
                token = search.choice(matcher, cap, state)
                if token is None:
                    return None
                step = [token]
            step = step[: limit - len(taken)]
            consumed = matcher.try_consume_tokens(step)  # all of it: forced or validated
            taken += step[:consumed]
            if consumed < len(step):
                return None
            if cap is not None:
                for token in step:
                    state, _ = cap.step(state, token)
    finally:
        if taken:
            matcher.rollback(len(taken))
    return _shorter(matcher, search, taken)


def _shorter(matcher: LLMatcher, search: Closer, plan: list[int]) -> list[int]:
    """``plan`` or its respelling, whichever is shorter and still closes."""
    if len(plan) < 2:
        return plan
    respelt = search.respell(plan)
    if len(respelt) >= len(plan):
        return plan
    if matcher.validate_tokens(respelt) < len(respelt):
        return plan
    matcher.consume_tokens(respelt)
    closes = matcher.is_accepting()
    matcher.rollback(len(respelt))
    return respelt if closes else plan
