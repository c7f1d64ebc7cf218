"""Where a repeat cuts its draft so that each near-tie is verified in the shape that chose it.

A repeat of a request drafts the earlier answer and verifies it in a few wide decodes. At a
near-tie (:data:`~worker.engine.proposers.confidence.NEAR_TIE_MARGIN`) the earlier run chose
its token in a decode of some other width, and a decode's width decides how a row rounds
(``bench/row_classes.py``: on the CPU 1, 2-3, 4, 5, 8-63 and 64+ rows each round their own
way). So the repeat can choose the other token there and write another text from then on:
Gemma 3 270M Q4_K_M on an Intel Xeon, the quote workload, token 7 chosen by the cold run at
row 0 of a 4-row verify ("was"), by every repeat at row 7 of a 12-row one ("is"); it parted
in 5 of 5 rounds and ran at 0.48x llama-server's ngram-mod, whose repeats kept their text.

So the output cache keeps, for each near-tie of an answer written by verifies that had the
decode to themselves, the row that chose it and how many rows that verify had, and a repeat
cuts its drafts so that the verify choosing the near-tie starts at the same position and
holds the same number of rows: one draft ends just before that verify's first row, and the
next holds exactly its rows. The rows before it were still written in other shapes, so this
makes a parting rarer, not impossible (``docs/benchmarks.md``, "Near-ties in their shape").
"""

from __future__ import annotations

from collections.abc import Mapping

#: A near-tie's shape: the row of its verify that chose it and the rows that verify had.
Shape = tuple[int, int]


def next_verify(pos: int, shapes: Mapping[int, Shape]) -> tuple[int, int] | None:
    """Where the verify of the next near-tie of ``shapes`` (output position -> :data:`Shape`)
    starts and how many rows it holds, when the next verify's first row chooses the output
    token at ``pos``; None when every near-tie's verify started before ``pos`` (passed, or
    missed: it cannot be made again)."""
    return min(((position - row, rows) for position, (row, rows) in shapes.items()
                if position - row >= pos), default=None)


def aligned_length(wanted: int, pos: int, verify: tuple[int, int]) -> int:
    """How many of ``wanted`` draft tokens to verify when the verify's first row chooses the
    output token at ``pos``, so that the near-tie ``verify`` (its start and rows,
    :func:`next_verify`) is made in that shape: a draft that would run across its start ends
    just before it (its bonus is the token before that start), and a draft starting there
    holds its rows less the one the last committed token takes."""
    start, rows = verify
    if start == pos:
        return min(wanted, rows - 1)
    return min(wanted, start - pos - 1)
