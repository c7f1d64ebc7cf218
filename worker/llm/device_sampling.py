"""Samplers on the device, written here as llama.cpp backend samplers: a greedy row's two best
tokens (:class:`Top2Chain`), and keyed draws (:class:`KeyedChain`) that draw each output row's
token by inverse CDF in token-id order from a uniform the caller chose.

Every tensor a row's graph ends in is flagged a graph output, whether llama.cpp hands it back
(a row of this sequence) or not (the dummy row a sequence with no outputs in a ubatch is built
on). ggml's allocator keeps the previous graph's plan, offset by node index, for a new graph of
as many nodes of no larger sizes (``ggml_gallocr_needs_realloc`` compares sizes only:
llama.cpp issue 28448). A sequence idle in one decode and verifying in the next moves the
nodes that are outputs: a dummy row's result, freed early in the old plan and its memory
given to a later row's, became an output at the same index, and the later row overwrote it.
llama.cpp's own ``top_k`` sampler does not flag the dummy row's tensors, and greedy verify
rows read on the device took another sequence's tokens (3 sequences, rows 2, 0, 1 then
0, 2, 1: 13 of 30 such decodes gave a wrong id, valid-looking, on the tiny model; on Gemma an
id of 1104416976, a logit's bits). Flagged, no row's result shares memory with another's in
any plan.

llama.cpp's own ``dist`` sampler draws on the device from its own generator; a request whose
draws are keyed on (seed, position) (``worker/engine/sampling.py``) cannot use it. This one has
the same graph with OUR uniforms as its inputs: per row, the weights of the host's target
distribution (``exp((z - max z) / T)``, 0 for ids the top-k and min-p cuts drop), their
cumulative sum in id order, and the number of ids whose cumulative weight is still at or
below ``u x total``. That index is the token plain host sampling draws with ``u``
(``Distribution.pick``), up to float32 rounding (docs/sampling.md, "Sampling on the device").
A top-p nucleus sorts the row on the device (``ggml_argsort``, as llama.cpp's own ``top_p``
backend sampler does) only to find where the nucleus ends; the draw stays in id order, and
ties at its end are kept by id, as the host's nucleus keeps them (:func:`_nucleus`). A bias
and penalties change the row first, bit for bit as the host does (:class:`Adjustment`,
:func:`_adjusted`).

The cumulative sum is taken in two levels (within blocks of :data:`BLOCK` ids, then over the
block totals): ggml's CPU ``cumsum`` adds one float32 at a time, and past a running sum near
1 it drops the ~10^5 tail probabilities of a 262k vocabulary under half an ulp each, shifting
later boundaries by up to 4e-4 (numpy emulation of a Gemma-like row); in blocks the error stays
under 5e-7.

The sampler is a ``llama_sampler_i`` whose callbacks are Python (ctypes CFUNCTYPEs) calling
ggml through ctypes (``libggml-base``; llama-cpp-python binds ``llama.h`` only). llama.cpp
builds a sampled graph by calling ``backend_apply`` once per output row of the sequence (and
once on a dummy row while the sequence has none in a ubatch), and calls ``backend_set_input``
once per ubatch before it runs (a reused graph gets only that call): the rows' uniforms are
staged before the decode (:meth:`KeyedChain.stage`) and handed out in row order, across the
ubatches of a decode. Each row's graph has inputs of its own, none shared with another row:
ggml's allocator reuses the previous graph's buffer offsets, node by node index, for a graph
of as many nodes of no larger sizes, so a tensor shared by a sequence's rows (one temperature
input) lived as long as the previous graph's layout said, and was overwritten when the rows
moved to another sequence (3 slots: rows 6,1,1 then 1,6,1 drew id n-1 from the second row
on). llama.cpp aborts on a bare sampler given to a sequence, so it sits alone in a chain; the
chain owns it, and is freed by whoever detaches it.
"""

from __future__ import annotations

import ctypes
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import llama_cpp
import numpy as np

from worker.llm.backend import LlamaError

_LIB_DIR = Path(llama_cpp.__file__).parent / "lib"
_P = ctypes.c_void_p
_F32 = ctypes.c_float
_I64 = ctypes.c_int64
#: ggml_type and ggml_sort_order (ggml.h).
_GGML_TYPE_F32, _GGML_TYPE_I32 = 0, 26
_GGML_SORT_ORDER_DESC = 1
#: Ids per block of the two-level cumulative sum.
BLOCK = 512
#: The logits width llama.cpp probes a sampler's graph with (``llama_sampler_backend_probe``):
#: the same for our own check of the device's ops.
_PROBE_WIDTH = 128 * 1024
#: The ids an adjustment of the probe's graph changes.
_PROBE_IDS = 64
#: Tensors one row's graph creates, with room to spare (the probe context's size).
_PROBE_TENSORS = 192
#: The widest row whose top-p nucleus the CPU backend sorts (a sequence whose output layer is
#: on the CPU: a CPU build with device verify forced on, or a model partly offloaded). ggml's
#: CPU argsort is one ``std::sort`` a row; measured (2-core Xeon, one thread) against the
#: host's nucleus, which sorts only the ids above a floor: 256 ids 0.04 ms against 0.06, 4,096
#: ids 0.39 against 0.07, Gemma's 262,144 ids 30 ms against 3.4. Wider rows are read.
CPU_SORT_MAX = 1024
#: ``ggml_backend_dev_type`` (ggml-backend.h) of the CPU and of accelerators beside it.
_DEVICE_TYPE_CPU, _DEVICE_TYPE_ACCEL = 0, 3
#: The min-p floor of a row without one: below every scaled logit (they are at most 0, and
#: finite), and finite, so no infinity meets a device's fast-math arithmetic.
NO_FLOOR = -1e30


class Draws(Protocol):
    """What a sequence sampled on the device draws with: its temperature (> 0), its cuts
    (``top_k`` 0, ``top_p`` 1 and ``min_p`` 0: none), and the uniform in [0, 1) that decides
    the token at each position."""

    @property
    def temperature(self) -> float: ...

    @property
    def top_k(self) -> int: ...

    @property
    def top_p(self) -> float: ...

    @property
    def min_p(self) -> float: ...

    @property
    def penalties(self) -> Adjusts | None:
        """What changes the logits before the draw (a bias, penalties), or None."""
        ...

    def uniforms(self, positions: Sequence[int]) -> list[float]:
        """The uniform deciding the token at each of ``positions``."""
        ...


class Adjusts(Protocol):
    """Where a sequence's rows' :class:`Adjustment` comes from (a request's bias and
    penalties, over what each row has seen)."""

    def adjustments(self, positions: Sequence[int],
                    batch: Mapping[int, int]) -> list[Adjustment]:
        """What changes the logits of the row choosing the token at each of ``positions``
        (it has seen the tokens before that position: ``batch`` maps the positions this
        decode holds to its tokens, drafts included)."""
        ...


class Greedy(NamedTuple):
    """A greedy sequence reduced on the device to each row's top two, of its logits as
    ``penalties`` adjust them (a greedy request with a bias or penalties; plain greedy is
    ``True``)."""

    penalties: Adjusts


class Adjustment(NamedTuple):
    """One row's logits changed before its draw, for the ids it changes, as the host's
    ``penalised_logits`` changes them: ``z[ids]`` becomes ``rep(z[ids] + bias) - minus``, where
    ``rep(v)`` is ``v / penalty`` above 0 and ``v * penalty`` at or below (a penalty of 1: none).
    Float32 arrays of one length; ``ids`` distinct (int32)."""

    ids: np.ndarray
    bias: np.ndarray
    penalty: np.ndarray
    minus: np.ndarray

    def padded(self, capacity: int, n_vocab: int) -> Adjustment:
        """This adjustment over ``capacity`` ids: the rest are ids it does not change, each
        changed by nothing (a bias of 0, a penalty of 1, nothing taken off, which gives a
        float32 back unchanged), distinct from its own (a scatter to one id twice is
        undefined in ggml)."""
        missing = capacity - len(self.ids)
        if missing < 0:
            raise ValueError(f"an adjustment of {len(self.ids)} ids over {capacity}")
        free = np.ones(min(n_vocab, capacity + len(self.ids)), bool)
        free[self.ids[self.ids < len(free)]] = False
        spare = np.flatnonzero(free)[:missing]
        f32 = np.float32
        return Adjustment(np.concatenate([self.ids, spare]).astype(np.int32),
                          np.concatenate([self.bias, np.zeros(missing, f32)]).astype(f32),
                          np.concatenate([self.penalty, np.ones(missing, f32)]).astype(f32),
                          np.concatenate([self.minus, np.zeros(missing, f32)]).astype(f32))


#: An adjustment that changes no id (a row llama.cpp builds beyond the staged ones).
_UNCHANGED = Adjustment(np.zeros(0, np.int32), *(np.zeros(0, np.float32),) * 3)


class _InitParams(ctypes.Structure):
    """``struct ggml_init_params``."""

    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", _P), ("no_alloc", ctypes.c_bool)]


@cache
def _ggml() -> ctypes.CDLL:
    """``libggml-base`` (tensors, ops, backend buffers) with the signatures used here; llama.cpp
    loaded it already."""
    lib = ctypes.CDLL(str(_LIB_DIR / "libggml-base.so"))
    unary = [_P, _P]
    binary = [_P, _P, _P]
    for name, args, result in (
        ("ggml_init", [_InitParams], _P),
        ("ggml_free", [_P], None),
        ("ggml_tensor_overhead", [], ctypes.c_size_t),
        ("ggml_new_tensor_1d", [_P, ctypes.c_int, _I64], _P),
        ("ggml_set_input", [_P], None),
        ("ggml_set_output", [_P], None),
        ("ggml_top_k", [_P, _P, ctypes.c_int], _P),
        ("ggml_argsort", [_P, _P, ctypes.c_int], _P),
        ("ggml_nelements", [_P], _I64),
        ("ggml_reshape_1d", [_P, _P, _I64], _P),
        ("ggml_reshape_2d", [_P, _P, _I64, _I64], _P),
        ("ggml_view_1d", [_P, _P, _I64, ctypes.c_size_t], _P),
        ("ggml_pad", [_P, _P, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int], _P),
        ("ggml_div", binary, _P),
        ("ggml_add", binary, _P),
        ("ggml_sub", binary, _P),
        ("ggml_mul", binary, _P),
        ("ggml_get_rows", binary, _P),
        ("ggml_set_rows", [_P, _P, _P, _P], _P),
        ("ggml_dup", unary, _P),
        ("ggml_exp", unary, _P),
        ("ggml_argmax", unary, _P),
        ("ggml_cumsum", unary, _P),
        ("ggml_sum_rows", unary, _P),
        ("ggml_sum", unary, _P),
        ("ggml_step", unary, _P),
        ("ggml_clamp", [_P, _P, _F32, _F32], _P),
        ("ggml_scale_bias", [_P, _P, _F32, _F32], _P),
        ("ggml_cast", [_P, _P, ctypes.c_int], _P),
        ("ggml_backend_tensor_set", [_P, _P, ctypes.c_size_t, ctypes.c_size_t], None),
        ("ggml_backend_buft_get_device", [_P], _P),
        ("ggml_backend_dev_supports_op", [_P, _P], ctypes.c_bool),
        ("ggml_backend_dev_type", [_P], ctypes.c_int),
    ):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    return lib


def draw_graph(ctx: int, logits: int, candidates: int | None, inputs: RowInputs,
               top_k: int = 0) -> tuple[int, list[int]]:
    """The graph of one row's draw in ggml context ``ctx``: ``logits`` (a row of n floats),
    the row's ``inputs`` (one float each) and ``candidates`` (the ids behind the logits'
    entries; None: entry i is id i); ``top_k`` (0 or n and over: none) cuts the row to the ids
    at or above its k-th largest logit, and ``inputs.mass`` (None: none) to the top-p nucleus.
    Returns the sampled id (an I32 tensor of one) and every tensor made, for a check of the
    device's ops.

    The weights are ``target_distribution``'s, op for op in float32: ``s = (z - max z) / T``,
    ``exp(s)`` where ``s`` is at or above the min-p floor (``inputs.floor``) and the k-th
    largest ``s`` and in the nucleus of those, 0 elsewhere. The index is
    n' - #{i : cdf[i] > u x total} over the padded n' = m x BLOCK entries, clamped to
    [0, n - 1]: the first id whose cumulative weight exceeds ``u x total``, as
    ``Distribution.pick`` (``searchsorted(..., side="right")``); an id cut adds nothing to the
    sum, so it is never the first to pass."""
    g = _ggml()
    made: list[int] = []

    def keep(t: int) -> int:
        made.append(t)
        return t

    n = int(g.ggml_nelements(logits))
    row = keep(g.ggml_reshape_1d(ctx, logits, n))
    if inputs.adjust is not None:
        row = _adjusted(ctx, row, inputs.adjust, keep)
    peak = keep(g.ggml_get_rows(ctx, _column(ctx, row, keep), keep(g.ggml_argmax(ctx, row))))
    scaled = keep(g.ggml_div(ctx, keep(g.ggml_sub(ctx, row, peak)), inputs.temperature))

    def at_least(floor: int) -> int:
        """1 where ``scaled`` >= ``floor`` (a tensor of one), else 0."""
        return _not(ctx, keep(g.ggml_step(ctx, keep(g.ggml_add(
            ctx, keep(g.ggml_scale_bias(ctx, scaled, -1.0, 0.0)), floor)))), keep)

    exps = keep(g.ggml_exp(ctx, scaled))
    kept = at_least(inputs.floor)
    cut = None
    if 0 < top_k < n:
        best = keep(g.ggml_get_rows(ctx, _column(ctx, scaled, keep),
                                    keep(g.ggml_top_k(ctx, scaled, top_k))))
        lowest = keep(g.ggml_argmax(ctx, keep(g.ggml_scale_bias(
            ctx, keep(g.ggml_reshape_1d(ctx, best, top_k)), -1.0, 0.0))))
        cut = at_least(keep(g.ggml_get_rows(ctx, best, lowest)))
        kept = keep(g.ggml_mul(ctx, kept, cut))
    if inputs.mass is not None:  # the nucleus of what the top-k cut kept, before min-p
        within = exps if cut is None else keep(g.ggml_mul(ctx, exps, cut))
        kept = keep(g.ggml_mul(ctx, kept, _nucleus(ctx, scaled, within, inputs.mass, keep)))
    weights = keep(g.ggml_mul(ctx, exps, kept))
    return _inverse_cdf(ctx, weights, candidates, inputs.uniform, keep), made


def _adjusted(ctx: int, row: int, adjust: AdjustInputs, keep: Callable[[int], int]) -> int:
    """A copy of ``row`` with its row's :class:`Adjustment` applied: the ids it changes
    gathered, changed op for op as the host's ``penalised_logits`` changes them (float32:
    ``v = z + bias``, ``v / penalty`` where ``v > 0`` else ``v * penalty``, less ``minus``;
    the two sides mixed by multiplying with 0 and 1, which is exact) and scattered back."""
    g = _ggml()
    n = int(g.ggml_nelements(row))
    cap = int(g.ggml_nelements(adjust.ids))
    column = keep(g.ggml_reshape_2d(ctx, keep(g.ggml_dup(ctx, row)), 1, n))

    def lined(t: int) -> int:  # one value an id, as the gathered ids are laid out
        return keep(g.ggml_reshape_2d(ctx, t, 1, cap))

    value = keep(g.ggml_add(ctx, keep(g.ggml_get_rows(ctx, column, adjust.ids)),
                            lined(adjust.bias)))
    above = keep(g.ggml_step(ctx, value))
    penalty = lined(adjust.penalty)
    penalised = keep(g.ggml_add(
        ctx, keep(g.ggml_mul(ctx, keep(g.ggml_div(ctx, value, penalty)), above)),
        keep(g.ggml_mul(ctx, keep(g.ggml_mul(ctx, value, penalty)), _not(ctx, above, keep)))))
    changed = keep(g.ggml_sub(ctx, penalised, lined(adjust.minus)))
    return keep(g.ggml_reshape_1d(ctx, keep(g.ggml_set_rows(ctx, column, changed, adjust.ids)),
                                  n))


def _column(ctx: int, row: int, keep: Callable[[int], int]) -> int:
    """A row of n as n rows of one, which ``ggml_get_rows`` picks entries of."""
    g = _ggml()
    return keep(g.ggml_reshape_2d(ctx, row, 1, g.ggml_nelements(row)))


def _not(ctx: int, mask: int, keep: Callable[[int], int]) -> int:
    """1 - ``mask``."""
    return keep(_ggml().ggml_scale_bias(ctx, mask, -1.0, 1.0))


def _nucleus(ctx: int, scaled: int, weights: int, mass: int,
             keep: Callable[[int], int]) -> int:
    """1 for the ids of the top-p nucleus of a row, 0 elsewhere: the smallest set of the most
    likely ids whose ``weights`` (0 for an id a cut dropped) hold ``mass`` of their total, as
    the host's ``_nucleus`` (``worker/engine/sampling.py``), in id order.

    The row is sorted by ``scaled`` (descending) only to find where the nucleus ends: ``c``,
    the number of sorted entries whose cumulative weight is still below ``mass x total``,
    plus one, and ``t``, the ``scaled`` of the c-th. The nucleus is every id above ``t`` and,
    of the ids at ``t``, as many of the lowest as make ``c`` in all: how the host orders ties
    (by id), whatever order the device's sort gave them. Sorted by ``scaled``, not by the
    weights: two ``scaled`` values close below 0 can round to one float32 weight, and the host
    orders them by ``scaled`` (its float64 weights keep them apart)."""
    g = _ggml()
    n = int(g.ggml_nelements(scaled))
    order = keep(g.ggml_argsort(ctx, scaled, _GGML_SORT_ORDER_DESC))
    by_weight = keep(g.ggml_get_rows(ctx, _column(ctx, weights, keep), order))
    cdf, total = _cumsum(ctx, keep(g.ggml_reshape_1d(ctx, by_weight, n)), keep)
    goal = keep(g.ggml_mul(ctx, mass, total))
    # #{cdf < goal} (the padding past n holds the total, never below it), clamped to a row.
    below = keep(g.ggml_clamp(ctx, keep(g.ggml_sum(ctx, keep(g.ggml_step(ctx, keep(g.ggml_add(
        ctx, keep(g.ggml_scale_bias(ctx, cdf, -1.0, 0.0)), goal)))))), 0.0, float(n - 1)))
    last = keep(g.ggml_cast(ctx, below, _GGML_TYPE_I32))
    by_scaled = keep(g.ggml_get_rows(ctx, _column(ctx, scaled, keep), order))
    edge = keep(g.ggml_get_rows(ctx, by_scaled, last))  # t
    over = keep(g.ggml_sub(ctx, scaled, edge))
    above = keep(g.ggml_step(ctx, over))
    under = keep(g.ggml_step(ctx, keep(g.ggml_scale_bias(ctx, over, -1.0, 0.0))))
    at_edge = _not(ctx, keep(g.ggml_add(ctx, above, under)), keep)
    # The ids at t to keep: c - #{above t}, the lowest first (their rank in id order).
    room = keep(g.ggml_sub(ctx, keep(g.ggml_scale_bias(ctx, below, 1.0, 1.5)),
                           keep(g.ggml_sum(ctx, above))))
    ranks, _ = _cumsum(ctx, at_edge, keep)
    rank = keep(g.ggml_view_1d(ctx, keep(g.ggml_reshape_1d(ctx, ranks, g.ggml_nelements(
        ranks))), n, 0))
    within = keep(g.ggml_step(ctx, keep(g.ggml_scale_bias(
        ctx, keep(g.ggml_sub(ctx, rank, room)), -1.0, 0.0))))
    return keep(g.ggml_add(ctx, above, keep(g.ggml_mul(ctx, at_edge, within))))


def _cumsum(ctx: int, weights: int, keep: Callable[[int], int]) -> tuple[int, int]:
    """The cumulative sum of a row of n ``weights`` in two levels (the module's docstring),
    padded with zeros to m x :data:`BLOCK` entries (a BLOCK x m tensor), and its total (one
    float)."""
    g = _ggml()
    n = int(g.ggml_nelements(weights))
    block = min(BLOCK, n)
    m = math.ceil(n / block)
    padded = m * block
    if padded > n:
        weights = keep(g.ggml_pad(ctx, weights, padded - n, 0, 0, 0))
    blocks = keep(g.ggml_reshape_2d(ctx, weights, block, m))
    within = keep(g.ggml_cumsum(ctx, blocks))
    totals = keep(g.ggml_reshape_1d(ctx, keep(g.ggml_sum_rows(ctx, blocks)), m))
    ends = keep(g.ggml_cumsum(ctx, totals))
    starts = keep(g.ggml_reshape_2d(ctx, keep(g.ggml_sub(ctx, ends, totals)), 1, m))
    cdf = keep(g.ggml_add(ctx, within, starts))
    return cdf, keep(g.ggml_view_1d(ctx, ends, 1, (m - 1) * ctypes.sizeof(_F32)))


def _inverse_cdf(ctx: int, weights: int, candidates: int | None, uniform: int,
                 keep: Callable[[int], int]) -> int:
    """The id ``uniform`` draws from a row of n ``weights`` (``draw_graph``'s index), every
    tensor made handed to ``keep``."""
    g = _ggml()
    n = int(g.ggml_nelements(weights))
    cdf, total = _cumsum(ctx, weights, keep)
    padded = int(g.ggml_nelements(cdf))
    target = keep(g.ggml_mul(ctx, uniform, total))
    above = keep(g.ggml_sum(ctx, keep(g.ggml_step(ctx, keep(g.ggml_sub(ctx, cdf, target))))))
    above = keep(g.ggml_clamp(ctx, above, float(padded - n + 1), float(padded)))
    index = keep(g.ggml_cast(ctx, keep(g.ggml_scale_bias(ctx, above, -1.0, float(padded))),
                             _GGML_TYPE_I32))
    if candidates:
        ids = keep(g.ggml_reshape_2d(ctx, candidates, 1, n))
        index = keep(g.ggml_get_rows(ctx, ids, index))
    return index


class AdjustInputs(NamedTuple):
    """One row's :class:`Adjustment` as input tensors of ``capacity`` entries each."""

    ids: int
    bias: int
    penalty: int
    minus: int

    @staticmethod
    def new(ctx: int, capacity: int) -> AdjustInputs:
        return AdjustInputs(_input(ctx, capacity, _GGML_TYPE_I32), _input(ctx, capacity),
                            _input(ctx, capacity), _input(ctx, capacity))


class RowInputs(NamedTuple):
    """One row's input tensors of its draw (one float each): the temperature, the min-p floor
    (``log(min_p)`` on the scaled logits, :data:`NO_FLOOR` without one), the uniform, the
    top-p mass (None: a graph without a nucleus; an input the graph does not use would have
    no memory to be set in), and its adjustment (None: the raw logits)."""

    temperature: int
    floor: int
    uniform: int
    mass: int | None = None
    adjust: AdjustInputs | None = None

    @staticmethod
    def new(ctx: int, nucleus: bool = False, capacity: int = 0) -> RowInputs:
        """Fresh inputs in ``ctx``: a row's own, shared with no other row (the module's
        docstring); ``capacity``: the ids its adjustment changes (0: none)."""
        return RowInputs(_input(ctx), _input(ctx), _input(ctx),
                         _input(ctx) if nucleus else None,
                         AdjustInputs.new(ctx, capacity) if capacity else None)


def _input(ctx: int, n: int = 1, kind: int = _GGML_TYPE_F32) -> int:
    """A new input tensor of ``ctx``: ``n`` floats (or int32s)."""
    g = _ggml()
    t = g.ggml_new_tensor_1d(ctx, kind, n)
    g.ggml_set_input(t)
    return int(t)


def _outputs(*tensors: int) -> None:
    """Flag a row's results as graph outputs, the dummy row's too (the module's docstring)."""
    g = _ggml()
    for t in tensors:
        g.ggml_set_output(t)


def top2_graph(ctx: int, logits: int,
               adjust: AdjustInputs | None = None) -> tuple[int, int, list[int]]:
    """The graph of one greedy row's two best tokens in ggml context ``ctx``: their ids (an I32
    tensor of two, in no set order) and their logits (two floats, adjusted by ``adjust``
    where given), and every tensor made."""
    g = _ggml()
    made: list[int] = []

    def keep(t: int) -> int:
        made.append(t)
        return t

    row = keep(g.ggml_reshape_1d(ctx, logits, g.ggml_nelements(logits)))
    if adjust is not None:
        row = _adjusted(ctx, row, adjust, keep)
    ids = keep(g.ggml_top_k(ctx, row, 2))
    best = keep(g.ggml_get_rows(ctx, _column(ctx, row, keep), ids))
    return ids, best, made


def _device_runs(buft: int | None, made: Callable[[int, int], list[int]]) -> bool:
    """Whether the device behind buffer type ``buft`` runs every op of a row's graph (no
    device: the CPU's, which runs them all), ``made(ctx, logits)`` building it on a probe
    graph as llama.cpp checks its own samplers'."""
    g = _ggml()
    device = g.ggml_backend_buft_get_device(buft) if buft else None
    if not device:
        return True
    ctx = g.ggml_init(_InitParams(_PROBE_TENSORS * g.ggml_tensor_overhead(), None, True))
    if not ctx:
        raise LlamaError("ggml could not create a probe context")
    try:
        logits = g.ggml_new_tensor_1d(ctx, _GGML_TYPE_F32, _PROBE_WIDTH)
        return all(g.ggml_backend_dev_supports_op(device, t) for t in made(ctx, logits))
    finally:
        g.ggml_free(ctx)


class Shape(NamedTuple):
    """What of a draw shapes its graph rather than its inputs: the top-k (the size of an op),
    whether it has a nucleus and whether it adjusts the logits (their ops are there or not).
    Draws of one shape share a chain; the temperature, the min-p floor, the top-p mass and
    the adjustments' values are only inputs (how many ids they change is the chain's
    capacity, which grows: :meth:`KeyedChain.stage`)."""

    top_k: int = 0
    nucleus: bool = False
    adjusts: bool = False

    @staticmethod
    def of(draws: Draws) -> Shape:
        return Shape(draws.top_k, draws.top_p < 1.0, draws.penalties is not None)


def device_supports_draws(buft: int | None, shape: Shape) -> bool:
    """Whether the device behind ``buft`` runs every op of a row's keyed draw of ``shape``
    (a nucleus needs ``argsort``: ggml's CUDA runs it on a 262k row only when built with
    CUB)."""
    return _device_runs(buft, lambda ctx, logits: draw_graph(
        ctx, logits, None, RowInputs.new(ctx, shape.nucleus, _PROBE_IDS if shape.adjusts else 0),
        shape.top_k)[1])


def sorts_cheaply(buft: int | None, n_vocab: int) -> bool:
    """Whether the device behind ``buft`` sorts a row of ``n_vocab`` ids for a nucleus at less
    cost than the host's nucleus: a GPU does; the CPU backend only up to
    :data:`CPU_SORT_MAX` ids."""
    g = _ggml()
    device = g.ggml_backend_buft_get_device(buft) if buft else None
    on_cpu = not device or g.ggml_backend_dev_type(device) in (_DEVICE_TYPE_CPU,
                                                               _DEVICE_TYPE_ACCEL)
    return not on_cpu or n_vocab <= CPU_SORT_MAX


def device_supports_top2(buft: int | None, adjusts: bool = False) -> bool:
    """Whether the device behind ``buft`` runs every op of a row's top two (``adjusts``: of
    its adjusted logits)."""
    return _device_runs(buft, lambda ctx, logits: top2_graph(
        ctx, logits, AdjustInputs.new(ctx, _PROBE_IDS) if adjusts else None)[2])


class RowAdjustments:
    """A chain's rows' adjustments: where they come from, the ids each row's inputs have room
    for (the chain's capacity: padded to it, :meth:`Adjustment.padded`), and the coming
    decode's, staged in row order."""

    def __init__(self, source: Adjusts, n_vocab: int, capacity: int) -> None:
        self.source = source
        self.capacity = min(max(capacity, 1), n_vocab)
        self.n_vocab = n_vocab
        self._staged: deque[Adjustment] = deque()

    def stage(self, positions: Sequence[int], batch: Mapping[int, int]) -> int:
        """Stage the adjustments of the rows choosing the tokens at ``positions``; returns
        how many ids the widest changes."""
        self._staged = deque(self.source.adjustments(positions, batch))
        return max((len(a.ids) for a in self._staged), default=0)

    def inputs(self, ctx: int) -> AdjustInputs:
        return AdjustInputs.new(ctx, self.capacity)

    def set(self, inputs: AdjustInputs) -> None:
        """Set a row's inputs to the next staged adjustment (none left: a row llama.cpp
        built beyond them, changed by nothing)."""
        g = _ggml()
        adjustment = (self._staged.popleft() if self._staged
                      else _UNCHANGED).padded(self.capacity, self.n_vocab)
        for tensor, values in zip(inputs, adjustment, strict=True):
            g.ggml_backend_tensor_set(tensor, values.ctypes.data, 0, values.nbytes)

    def clear(self) -> None:
        self._staged.clear()


class DeviceChain:
    """One sequence's chain of a single backend sampler of ours, and the Python state behind
    it: the callbacks llama.cpp calls while it builds and runs a sampled graph. They never
    raise into llama.cpp: a failure is kept and raised by :meth:`settle` after the decode."""

    _NAME = ctypes.create_string_buffer(b"specfleet-device")

    def __init__(self) -> None:
        #: Whether the output device runs the sampler's ops (``backend_init``'s answer); a
        #: chain llama.cpp took without them samples nothing.
        self.supported = False
        #: Why it does not, where it does not.
        self.refusal = "the output device lacks an op of the sampler: its rows are read on the host"
        self._error: BaseException | None = None
        i = llama_cpp
        # The callbacks and the interface must outlive the chain: llama.cpp holds pointers.
        self._callbacks: list[Any] = [
            ctypes.CFUNCTYPE(_P, i.llama_sampler_p_ctypes)(self._name),
            i.llama_sampler_i_backend_init(self._backend_init),
            i.llama_sampler_i_backend_apply(self._backend_apply),
            i.llama_sampler_i_backend_set_input(self._backend_set_input),
            i.llama_sampler_i_backend_reset(self._backend_reset),
        ]
        name, init, apply, set_input, reset = self._callbacks
        self._iface = i.llama_sampler_i(
            name=ctypes.cast(name, i.llama_sampler_i_name), backend_init=init,
            backend_apply=apply, backend_set_input=set_input, backend_reset=reset)
        sampler = i.llama_sampler_init(ctypes.byref(self._iface), None)
        self.chain: Any = i.llama_sampler_chain_init(i.llama_sampler_chain_default_params())
        i.llama_sampler_chain_add(self.chain, sampler)  # the chain owns (and frees) it

    def settle(self) -> None:
        """After the decode: nothing failed."""
        error, self._error = self._error, None
        if error is not None:
            raise LlamaError(f"the device sampler failed: {error!r}") from error

    def free(self) -> None:
        """Free the chain (and the sampler in it): only once no context holds it."""
        if self.chain is not None:
            llama_cpp.llama_sampler_free(self.chain)
            self.chain = None

    # -- what a sampler of ours does -------------------------------------------------------
    def supports(self, buft: int | None) -> bool:
        """Whether the device behind ``buft`` runs this sampler's ops."""
        raise NotImplementedError

    def build(self, ctx: int, row: Any) -> None:
        """Add one row's graph to ``ctx``: ``row`` is its ``llama_sampler_data``, whose
        tensors say what llama.cpp reads back."""
        raise NotImplementedError

    def set_inputs(self) -> None:
        """Set the graph's inputs before it runs (a reused graph gets only this call)."""

    def reset(self) -> None:
        """A new graph is being built: forget the last one's tensors."""

    # -- llama.cpp's callbacks ---------------------------------------------------------------
    def _name(self, smpl: Any) -> int | None:
        return ctypes.addressof(self._NAME)

    def _backend_init(self, smpl: Any, buft: int | None, n_outputs_max_per_seq: int) -> bool:
        try:
            self.supported = self.supports(buft)
        except BaseException as e:  # noqa: BLE001 (kept for settle: never raise into C)
            self._error, self.supported = e, False
        return self.supported

    def _backend_apply(self, smpl: Any, ctx: int | None, gf: int | None,
                       data: Any) -> None:
        try:
            assert ctx
            self.build(ctx, data.contents)
        except BaseException as e:  # noqa: BLE001
            self._error = e

    def _backend_set_input(self, smpl: Any) -> None:
        try:
            self.set_inputs()
        except BaseException as e:  # noqa: BLE001
            self._error = e

    def _backend_reset(self, smpl: Any) -> None:
        self.reset()


class Top2Chain(DeviceChain):
    """A greedy sequence's chain: each row reduced to its two best tokens, their ids as the
    row's candidates and their logits as its logits (``Context.top2`` reads them), nothing
    chosen; with ``penalties``, of the logits as they adjust them. llama.cpp's own
    ``top_k(2)`` builds the same graph but leaves the dummy row's tensors unflagged (the
    module's docstring)."""

    _NAME = ctypes.create_string_buffer(b"specfleet-top2")

    def __init__(self, penalties: Adjusts | None = None, n_vocab: int = 0,
                 capacity: int = 0) -> None:
        #: The rows' adjustments (None: the raw logits).
        self.adjusting = (RowAdjustments(penalties, n_vocab, capacity)
                          if penalties is not None else None)
        self._inputs: list[AdjustInputs] = []
        super().__init__()

    def wider(self, capacity: int) -> Top2Chain:
        """A chain like this one whose rows' adjustments have room for ``capacity`` ids."""
        assert self.adjusting is not None
        return Top2Chain(self.adjusting.source, self.adjusting.n_vocab, capacity)

    def stage(self, positions: Sequence[int], batch: Mapping[int, int]) -> int:
        """The coming decode's rows of this sequence choose the tokens at ``positions``;
        returns how many ids the widest row's adjustment changes (0 without)."""
        return self.adjusting.stage(positions, batch) if self.adjusting else 0

    def supports(self, buft: int | None) -> bool:
        return device_supports_top2(buft, self.adjusting is not None)

    def build(self, ctx: int, row: Any) -> None:
        inputs = None
        if self.adjusting is not None:
            inputs = self.adjusting.inputs(ctx)
            self._inputs.append(inputs)
        ids, best, _ = top2_graph(ctx, row.logits, inputs)
        _outputs(ids, best)
        row.candidates, row.logits = ids, best

    def set_inputs(self) -> None:
        if self.adjusting is not None:
            for inputs in self._inputs:
                self.adjusting.set(inputs)

    def reset(self) -> None:
        self._inputs.clear()

    def settle(self) -> None:
        super().settle()
        if self.adjusting is not None:
            self.adjusting.clear()


class KeyedChain(DeviceChain):
    """A sampled sequence's chain of a single keyed-draw sampler, and the draws behind it.

    ``draws`` may be replaced between requests of the same :class:`Shape` (a sequence keeps
    its chain: an attach costs the next decode a graph rebuild); the temperature, the min-p
    floor, the top-p mass and the adjustments' values are inputs, so they change nothing in
    the graph, but ``top_k`` is the size of an op in it and a nucleus or an adjustment adds
    ops: another shape needs another chain. So does an adjustment of more ids than the
    chain's room (:meth:`stage` says how many the coming decode's rows change)."""

    _NAME = ctypes.create_string_buffer(b"specfleet-keyed-dist")

    def __init__(self, draws: Draws, n_vocab: int, capacity: int = 0) -> None:
        #: The shape the graph is built with (``draws`` keep it while they are replaced).
        self.shape = Shape.of(draws)
        self._n_vocab = n_vocab
        #: The rows' adjustments (None: the raw logits).
        self.adjusting = (RowAdjustments(draws.penalties, n_vocab, capacity)
                          if draws.penalties is not None else None)
        self.draws = draws
        #: Each row's input tensors in the graph being built.
        self._inputs: list[RowInputs] = []
        self._staged: deque[float] = deque()
        self._short = 0  # rows llama.cpp set inputs for beyond the staged uniforms
        super().__init__()

    def redraw(self, draws: Draws) -> None:
        """Draw with ``draws`` (of this chain's shape) from the next decode on."""
        self.draws = draws
        if self.adjusting is not None and draws.penalties is not None:
            self.adjusting.source = draws.penalties

    def wider(self, capacity: int) -> KeyedChain:
        """A chain like this one whose rows' adjustments have room for ``capacity`` ids."""
        return KeyedChain(self.draws, self._n_vocab, capacity)

    def stage(self, positions: Sequence[int], batch: Mapping[int, int]) -> int:
        """The coming decode's rows of this sequence draw the tokens at ``positions``, in
        batch order (empty: it has none); ``batch`` maps the positions the decode holds to
        its tokens. Returns how many ids the widest row's adjustment changes (0 without)."""
        self._staged = deque(self.draws.uniforms(positions))
        self._short = 0
        return self.adjusting.stage(positions, batch) if self.adjusting else 0

    def settle(self) -> None:
        """After the decode: every staged uniform went to a row, and nothing failed."""
        super().settle()
        if self.adjusting is not None:
            self.adjusting.clear()
        if self._staged or self._short:
            left, short = len(self._staged), self._short
            self._staged.clear()
            raise LlamaError(f"llama.cpp sampled {short} row(s) with no staged uniform and "
                             f"left {left} staged uniform(s) unused")

    def supports(self, buft: int | None) -> bool:
        if self.shape.nucleus and not sorts_cheaply(buft, self._n_vocab):
            self.refusal = (f"the output layer is on the CPU, where sorting {self._n_vocab} ids "
                            "for a top-p nucleus costs more than the host's nucleus: sampled "
                            "rows are read on the host")
            return False
        return device_supports_draws(buft, self.shape)

    def build(self, ctx: int, row: Any) -> None:
        inputs = RowInputs.new(ctx, self.shape.nucleus,
                               self.adjusting.capacity if self.adjusting else 0)
        self._inputs.append(inputs)
        row.sampled, _ = draw_graph(ctx, row.logits, row.candidates, inputs, self.shape.top_k)
        _outputs(row.sampled)
        # Neither the row's logits nor its probabilities go back to the host: only the id.
        row.logits = row.probs = None

    def set_inputs(self) -> None:
        g = _ggml()
        min_p = self.draws.min_p
        temperature = _F32(self.draws.temperature)
        floor = _F32(math.log(min_p) if min_p > 0.0 else NO_FLOOR)
        mass = _F32(self.draws.top_p)
        for inputs in self._inputs:
            if self._staged:
                value = _F32(self._staged.popleft())
            else:
                self._short += 1
                value = _F32(0.0)
            g.ggml_backend_tensor_set(inputs.temperature, ctypes.byref(temperature), 0, 4)
            g.ggml_backend_tensor_set(inputs.floor, ctypes.byref(floor), 0, 4)
            g.ggml_backend_tensor_set(inputs.uniform, ctypes.byref(value), 0, 4)
            if inputs.mass is not None:
                g.ggml_backend_tensor_set(inputs.mass, ctypes.byref(mass), 0, 4)
            if inputs.adjust is not None and self.adjusting is not None:
                self.adjusting.set(inputs.adjust)

    def reset(self) -> None:
        self._inputs.clear()
