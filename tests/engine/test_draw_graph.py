"""The device's keyed draw, graph by graph: ``draw_graph`` built in a ggml context of its own and
computed by ggml's CPU backend on rows made to test it (ties at the k-th logit and at the end
of the top-p nucleus, rows over several blocks of the cumulative sum, padding), against the
host's ``target_distribution``; the bias and penalties' adjustment against the host's
``penalised_logits``, bit for bit. An engine test draws through llama.cpp on a model's rows
(``test_device_sampling.py``); here the rows are chosen, so the edge cases are there for sure.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from shared.protocol import SamplingParams
from worker.engine.penalties import adjustment
from worker.engine.sampling import _nucleus, penalised_logits, target_distribution
from worker.llm import device_sampling
from worker.llm.device_sampling import (
    NO_FLOOR,
    AdjustInputs,
    RowInputs,
    _adjusted,
    draw_graph,
)

_P = ctypes.c_void_p
#: Room for one row's graph and its tensors' data (a few rows of a few thousand floats each).
_ARENA = 64 * 1024 * 1024


def _lib(name: str) -> ctypes.CDLL:
    return ctypes.CDLL(str(device_sampling._LIB_DIR / name))


@pytest.fixture(scope="module")
def ggml() -> Iterator[tuple[ctypes.CDLL, ctypes.CDLL]]:
    base = device_sampling._ggml()
    cpu = _lib("libggml-cpu.so")
    for lib, name, args, result in (
        (base, "ggml_new_graph", [_P], _P),
        (base, "ggml_build_forward_expand", [_P, _P], None),
        (base, "ggml_get_data", [_P], _P),
        (cpu, "ggml_graph_compute_with_ctx", [_P, _P, ctypes.c_int], ctypes.c_int),
    ):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    yield base, cpu


class Graph:
    """One row's graph in a ggml context of its own, its inputs set and its outputs read as
    numpy arrays."""

    def __init__(self, libs: tuple[ctypes.CDLL, ctypes.CDLL], ctx: int, n: int,
                 nucleus: bool) -> None:
        self._base, self._cpu = libs
        self.ctx = ctx
        self.logits = int(self._base.ggml_new_tensor_1d(ctx, 0, n))
        self._base.ggml_set_input(self.logits)
        self.inputs = RowInputs.new(ctx, nucleus)

    def set(self, tensor: int | None, values: np.ndarray | float) -> None:
        data = np.ascontiguousarray(values, dtype=np.float32).ravel()
        assert tensor is not None
        ctypes.memmove(self._base.ggml_get_data(tensor), data.ctypes.data, data.nbytes)

    def compute(self, out: int, n: int, dtype: type = np.int32) -> np.ndarray:
        graph = self._base.ggml_new_graph(self.ctx)
        self._base.ggml_build_forward_expand(graph, out)
        assert self._cpu.ggml_graph_compute_with_ctx(self.ctx, graph, 1) == 0
        return np.ctypeslib.as_array(
            ctypes.cast(self._base.ggml_get_data(out), ctypes.POINTER(
                ctypes.c_int32 if dtype is np.int32 else ctypes.c_float)), (n,)).copy()


@contextmanager
def graph(ggml: tuple[ctypes.CDLL, ctypes.CDLL], n: int,
          nucleus: bool) -> Iterator[Graph]:
    base = ggml[0]
    ctx = base.ggml_init(device_sampling._InitParams(_ARENA, None, False))
    assert ctx
    try:
        yield Graph(ggml, ctx, n, nucleus)
    finally:
        base.ggml_free(ctx)


def _draws(ggml: tuple[ctypes.CDLL, ctypes.CDLL], logits: np.ndarray,
           params: SamplingParams, uniforms: np.ndarray) -> list[int]:
    """The device graph's draw for each of ``uniforms`` from the row ``logits``."""
    nucleus = params.top_p < 1.0
    with graph(ggml, len(logits), nucleus) as g:
        index, _ = draw_graph(g.ctx, g.logits, None, g.inputs, params.top_k)
        g.set(g.logits, logits)
        g.set(g.inputs.temperature, params.temperature)
        g.set(g.inputs.floor, np.log(params.min_p) if params.min_p > 0 else NO_FLOOR)
        if nucleus:
            g.set(g.inputs.mass, params.top_p)
        out = []
        for u in uniforms:
            g.set(g.inputs.uniform, u)
            out.append(int(g.compute(index, 1)[0]))
        return out


def _tied_row(rng: np.random.Generator, n: int) -> np.ndarray:
    """Logits on a coarse grid (many exact ties everywhere) with a few well-separated leaders."""
    z = rng.integers(-40, 8, n).astype(np.float32) / 4
    z[rng.choice(n, 6, replace=False)] = [6.0, 5.5, 5.5, 5.5, 5.0, 5.0]
    return z


def _edge_clear(logits: np.ndarray, params: SamplingParams) -> bool:
    """Whether the host's nucleus of this row ends clear of float32 rounding: the goal is not
    within 1e-5 of a cumulative weight of the sorted row (where float32 and float64 part)."""
    z = (logits - logits.max()) / params.temperature
    keep = None
    if 0 < params.top_k < len(z):
        kth = np.partition(z, len(z) - params.top_k)[len(z) - params.top_k]
        keep = np.flatnonzero(z >= kth)
    w = np.exp(z if keep is None else z[keep], dtype=np.float64)
    cdf = np.cumsum(np.sort(w)[::-1]) / w.sum()
    return bool(np.abs(cdf - params.top_p).min() > 1e-5)


NUCLEI = [SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=0.7, top_p=0.9),
          SamplingParams(temperature=1.3, top_p=0.95, top_k=40),
          SamplingParams(temperature=1.0, top_p=0.8, min_p=0.005),
          SamplingParams(temperature=2.0, top_p=0.3, top_k=300, min_p=0.001)]


@pytest.mark.parametrize("n", [300, 1500], ids=["one-block", "three-blocks"])
@pytest.mark.parametrize("params", NUCLEI, ids=[f"nucleus{i}" for i in range(len(NUCLEI))])
def test_the_nucleus_draw_is_the_hosts(ggml: tuple[ctypes.CDLL, ctypes.CDLL], n: int,
                                       params: SamplingParams) -> None:
    """Rows full of exact ties, their nuclei ending clear of rounding: for uniforms all across
    [0, 1), the device's id is the one the host's distribution picks; and the nucleus cut
    changed some of them (the same draws without it differ)."""
    rng = np.random.default_rng(n + int(100 * params.top_p))
    uniforms = np.linspace(0.0, 0.999, 97)
    changed = 0
    rows = 0
    while rows < 3:
        z = _tied_row(rng, n)
        if not _edge_clear(z, params):
            continue
        rows += 1
        want = [target_distribution(z, params, [], 0).pick(u) for u in uniforms]
        assert _draws(ggml, z, params, uniforms) == want
        uncut = params.model_copy(update={"top_p": 1.0})
        changed += want != [target_distribution(z, uncut, [], 0).pick(u) for u in uniforms]
    assert changed, "the nucleus never changed a draw"


def test_ties_at_the_end_of_the_nucleus_are_kept_by_id(
        ggml: tuple[ctypes.CDLL, ctypes.CDLL]) -> None:
    """A nucleus that ends inside a run of equal logits keeps the lowest ids of the run, as
    the host orders ties, whatever order the device's sort left them in: here one of four
    tied ids (the mass 0.5 is reached by the leader and the first of them), with the run's
    ids spread out and not in ascending order of position."""
    n = 600
    z = np.full(n, -30.0, dtype=np.float32)
    z[[17] + [430, 9, 250, 71]] = [2.0, 1.0, 1.0, 1.0, 1.0]
    params = SamplingParams(temperature=1.0, top_p=0.5)
    assert _nucleus((z - z.max()) / 1.0, None, 0.5).tolist() == [9, 17]
    picks = set(_draws(ggml, z, params, np.linspace(0.0, 0.999, 50)))
    assert picks == {9, 17}


def test_a_nucleus_over_every_id_draws_as_no_cut(ggml: tuple[ctypes.CDLL, ctypes.CDLL]) -> None:
    """A mass the whole row barely reaches keeps every id that has weight: the draws are the
    uncut row's (the count of sorted ids below the goal is clamped to the row)."""
    z = _tied_row(np.random.default_rng(5), 700)
    uniforms = np.linspace(0.0, 0.999, 41)
    uncut = SamplingParams(temperature=1.0)
    want = [target_distribution(z, uncut, [], 0).pick(u) for u in uniforms]
    assert _draws(ggml, z, SamplingParams(temperature=1.0, top_p=0.9999999), uniforms) == want


ADJUSTED = [SamplingParams(temperature=1.0, repetition_penalty=1.3),
            SamplingParams(temperature=1.0, presence_penalty=0.7, frequency_penalty=0.3),
            SamplingParams(temperature=1.0, logit_bias={3: 5.0, 40: -100.0, 77: 0.25}),
            SamplingParams(temperature=1.0, logit_bias={5: 2.0, 9: -1.5},
                           repetition_penalty=0.8, presence_penalty=-0.5,
                           frequency_penalty=0.2)]


@pytest.mark.parametrize("params", ADJUSTED, ids=["repetition", "presence+frequency", "bias",
                                                  "all"])
def test_the_adjusted_row_is_the_hosts_bit_for_bit(ggml: tuple[ctypes.CDLL, ctypes.CDLL],
                                                   params: SamplingParams) -> None:
    """The device's bias and penalties (gather, change, scatter back over room for more ids
    than change: the padding changes nothing) give the host's ``penalised_logits`` exactly,
    on logits of both signs (the repetition penalty divides above 0 and multiplies below)."""
    n, capacity = 700, 256
    rng = np.random.default_rng(len(str(params)))
    z = (rng.standard_normal(n) * 4).astype(np.float32)
    history = rng.integers(0, n, 120).tolist()
    change = adjustment(params, history, 50)
    assert 0 < len(change.ids) < capacity
    with graph(ggml, n, False) as g:
        inputs = AdjustInputs.new(g.ctx, capacity)
        out = _adjusted(g.ctx, g.logits, inputs, lambda t: t)
        g.set(g.logits, z)
        padded = change.padded(capacity, n)
        for tensor, values in zip(inputs, padded, strict=True):
            ctypes.memmove(ggml[0].ggml_get_data(tensor), values.ctypes.data, values.nbytes)
        got = g.compute(out, n, np.float32)
    want = penalised_logits(z, params, history, 50)
    assert not np.array_equal(want, z), "the adjustment changed nothing"
    assert np.array_equal(got.view(np.int32), want.view(np.int32))


def test_padding_an_adjustment_adds_distinct_ids_it_does_not_change() -> None:
    """Room for more ids than an adjustment changes is filled with other ids, each distinct
    (a scatter to one id twice is undefined), changed by nothing."""
    params = SamplingParams(temperature=1.0, logit_bias={0: 1.0, 2: -1.0}, presence_penalty=0.5)
    change = adjustment(params, [1, 4, 4], 1)  # id 1 is the prompt's: no penalty but repetition
    assert change.ids.tolist() == [0, 2, 4] and change.minus.tolist() == [0, 0, 0.5]
    padded = change.padded(9, 12)
    assert len(set(padded.ids.tolist())) == 9
    assert padded.ids[:3].tolist() == [0, 2, 4]
    assert padded.bias[3:].tolist() == [0] * 6 and padded.penalty[3:].tolist() == [1] * 6
    assert padded.minus[3:].tolist() == [0] * 6
    with pytest.raises(ValueError, match="3 ids over 2"):
        change.padded(2, 12)
