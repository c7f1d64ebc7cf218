"""llama.cpp's cap on a JSON number's digits, applied to a constrained slot's tokens.

llama.cpp's json-schema-to-grammar (``common/json-schema-to-grammar.cpp``) writes a number's
integral part as ``[0] | [1-9] [0-9]{0,15}``, its fraction as ``[0-9]{1,16}`` and its
exponent as another integral part (an integer is an integral part), so llama-server never
writes more than 16 digits in a row of a number. llguidance 1.9 has no such knob: its JSON
options (``x-guidance``: separators, whitespace, ``coerce_one_of``, ``lenient``, escapes) say
nothing of numbers, every number regex its compiler builds ends in an unbounded digit run
(``rx_float_range``: a ``number`` in ``[0, 1]`` allows ``1.000…``), JSON Schema puts no
``pattern`` on a number, and ``multipleOf`` is a u32 decimal (``1e-16`` overflows it). So the
schema is left as it is and the cap is applied to the slot's tokens instead, by a small
automaton over the output's bytes: outside JSON strings (quotes and escapes tracked), a run
of more than :data:`MAX_DIGITS` digits is forbidden. Outside strings JSON has digits only in
numbers, and their runs are exactly the integral part, the fraction and the exponent, so this
is llama.cpp's cap wherever the JSON sits and whatever produced it: a ``json_object``, a
``json_schema`` (bounded numbers too), a tool call's ``%json`` arguments.

Where the output is JSON is the constraint's to say (``Constraint.json_from``): from its first
byte (the JSON kinds; tool calls when every alternative is JSON), from an opening text (tool
calls beside free text: output that opens with the call marker is calls, any other output
is the message and stays uncapped), or nowhere. The cap yields where it would leave nothing
(a grammar that forces a longer run: a ``const``), so it never ends a generation.
"""

from __future__ import annotations

import threading
from weakref import WeakKeyDictionary

import numpy as np

from worker.engine.constraint.tokenizer import GrammarVocab

#: llama.cpp's cap: digits in a row of a JSON number (integral part, fraction, exponent).
MAX_DIGITS = 16
#: The automaton's states: 0..MAX_DIGITS outside a string after that many digits in a row;
#: inside a string; after a backslash in one; not JSON (nothing capped); and from OPENING on,
#: that many bytes of the opening text matched.
IN_STRING = MAX_DIGITS + 1
ESCAPED = MAX_DIGITS + 2
FREE = MAX_DIGITS + 3
OPENING = MAX_DIGITS + 4

_QUOTE, _BACKSLASH, _ZERO, _NINE = ord('"'), ord("\\"), ord("0"), ord("9")


class _DigitTable:
    """Per vocabulary: each token's leading digits, and the tokens with more digits than the
    cap (only those can break it on their own, so only those are walked byte by byte)."""

    def __init__(self, vocab: GrammarVocab) -> None:
        lead = np.zeros(vocab.n_vocab, dtype=np.int32)
        long: list[int] = []
        digits = b"0123456789"
        for token, piece in enumerate(vocab.pieces[: vocab.n_vocab]):
            count = len(piece) - len(piece.translate(None, digits))
            if not count:
                continue
            lead[token] = len(piece) - len(piece.lstrip(digits))
            if count > MAX_DIGITS:
                long.append(token)
        self.lead = lead
        self.long = np.asarray(long, dtype=np.int64)


_TABLES: WeakKeyDictionary[GrammarVocab, _DigitTable] = WeakKeyDictionary()
_CAPS: WeakKeyDictionary[GrammarVocab, dict[bytes, NumberCap]] = WeakKeyDictionary()
_LOCK = threading.Lock()


def number_cap(vocab: GrammarVocab, opening: bytes) -> NumberCap:
    """The cap over ``vocab`` for output whose JSON starts after ``opening`` (b"": at once),
    built once per vocabulary and opening (grammars compile on threads of their own)."""
    with _LOCK:
        table = _TABLES.get(vocab)
        if table is None:
            table = _TABLES[vocab] = _DigitTable(vocab)
        caps = _CAPS.setdefault(vocab, {})
        cap = caps.get(opening)
        if cap is None:
            cap = caps[opening] = NumberCap(vocab, table, opening)
        return cap


class NumberCap:
    """The automaton over one vocabulary: :meth:`step` follows a token, :meth:`forbidden`
    names every token that would break the cap from a state (cached per state)."""

    def __init__(self, vocab: GrammarVocab, table: _DigitTable, opening: bytes) -> None:
        self._pieces = vocab.pieces
        self._table = table
        self._opening = opening
        self.start = OPENING if opening else 0
        self._forbidden: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def step(self, state: int, token: int) -> tuple[int, bool]:
        """The state after ``token`` from ``state``, and whether the token ran a number past
        the cap (then its run stays at the cap, so what follows is judged from there)."""
        over = False
        for byte in self._pieces[token]:
            if state == FREE:
                break
            if state >= OPENING:
                k = state - OPENING
                if byte != self._opening[k]:
                    state = FREE
                else:
                    state = 0 if k + 1 == len(self._opening) else state + 1
            elif state == IN_STRING:
                state = ESCAPED if byte == _BACKSLASH else 0 if byte == _QUOTE else IN_STRING
            elif state == ESCAPED:
                state = IN_STRING
            elif _ZERO <= byte <= _NINE:
                if state == MAX_DIGITS:
                    over = True
                else:
                    state += 1
            else:
                state = IN_STRING if byte == _QUOTE else 0
        return state, over

    def forbidden(self, state: int) -> np.ndarray:
        """Per token id, True where the token would run a number past the cap from
        ``state``: from outside a string after ``d`` digits, a token that starts with more
        than ``MAX_DIGITS - d`` of them; from any state, a token whose own digits break it."""
        with self._lock:
            bad = self._forbidden.get(state)
            if bad is None:
                if state <= MAX_DIGITS:
                    bad = self._table.lead > MAX_DIGITS - state
                else:
                    bad = np.zeros(len(self._table.lead), dtype=np.bool_)
                for token in self._table.long:
                    if self.step(state, int(token))[1]:
                        bad[token] = True
                self._forbidden[state] = bad
            return bad

    def in_string(self, state: int) -> bool:
        """Inside a JSON string (what ends it is a quote, not a bracket)."""
        return state in (IN_STRING, ESCAPED)
