"""Structured random weights that make a tiny model's greedy decoding worth speculating on.

Plain Gaussian weights give a model whose next token no drafter can guess (~0% acceptance),
which leaves rollback and telemetry untested. Instead every tiny model shares one skeleton:

* token embeddings ``E`` are random vectors of RMS 1;
* the output layer scores token ``v`` by how well the final hidden state matches
  ``E[perm^-1(v)]``, so a hidden state close to ``E[t]`` predicts ``perm(t)`` with a wide margin;
* the residual stream keeps ``E[t]`` (blocks write small updates), while the blocks' mixing
  weights add context-dependent pushes that sometimes win and send greedy elsewhere;
* ``perm`` is made of short cycles, so greedy text keeps revisiting the same n-grams.

A drafter that predicts ``perm`` (the MTP head) is then right most of the time but not always,
and an n-gram drafter finds repeats that the context sometimes breaks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

F32 = np.float32


@dataclass(frozen=True)
class Dims:
    """Shapes shared by every tiny model (numpy arrays are (out, in): ggml's order reversed)."""

    n_vocab: int = 256
    n_embd: int = 64
    n_head: int = 2
    n_head_kv: int = 1
    head_dim: int = 32
    n_ff: int = 128


@dataclass(frozen=True)
class Strengths:
    """How hard each kind of block pushes away from ``perm``; tuned for ~50% MTP acceptance."""

    #: logit of the permutation's token when the hidden state is exactly ``E[t]``.
    logit_scale: float = 40.0
    #: gain of attention output projections (context from earlier tokens).
    attention: float = 0.6
    #: gain of feed-forward down projections (a nonlinear function of the mix).
    ffn: float = 0.3
    #: gain of the delta-net output projections (hybrid only).
    delta_net: float = 0.6
    #: weight of the target's hidden state in the MTP head's input projection.
    mtp_hidden: float = 0.2
    #: gain of the MTP block's own attention and feed-forward.
    mtp_block: float = 0.1
    cycle_len: int = 8


class Recipe:
    """Deterministic weight factory: the same ``seed`` and component name give the same array.

    Each component draws from its own generator keyed by (seed, name), so the head-less twin
    of the hybrid model gets byte-identical trunk weights without replaying the MTP draws.
    """

    def __init__(self, seed: int, dims: Dims = Dims(), strengths: Strengths = Strengths()) -> None:
        self.seed = seed
        self.dims = dims
        self.strengths = strengths
        rng = self.rng("embeddings")
        embd = rng.standard_normal((dims.n_vocab, dims.n_embd))
        embd *= np.sqrt(dims.n_embd) / np.linalg.norm(embd, axis=1, keepdims=True)
        self.embd = embd.astype(F32)
        self.perm = self._short_cycles(self.rng("permutation"), dims.n_vocab, strengths.cycle_len)

    def rng(self, name: str) -> np.random.Generator:
        key = [self.seed, *name.encode()]
        return np.random.default_rng(key)

    @staticmethod
    def _short_cycles(rng: np.random.Generator, n: int, cycle_len: int) -> np.ndarray:
        """A permutation made of cycles of ``cycle_len`` tokens (shuffled membership)."""
        order = rng.permutation(n)
        perm = np.empty(n, dtype=np.int64)
        for start in range(0, n, cycle_len):
            cycle = order[start:start + cycle_len]
            perm[cycle] = np.roll(cycle, -1)
        return perm

    # -- the skeleton ----------------------------------------------------------------------
    def token_embd(self) -> np.ndarray:
        return self.embd

    def output(self) -> np.ndarray:
        """Row ``v`` is ``E[perm^-1(v)]`` scaled so an exact match scores ``logit_scale``."""
        inverse = np.argsort(self.perm)
        return (self.embd[inverse] * (self.strengths.logit_scale / self.dims.n_embd)).astype(F32)

    # -- generic parts ---------------------------------------------------------------------
    @staticmethod
    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=F32)

    def matrix(self, name: str, n_out: int, n_in: int, gain: float = 1.0) -> np.ndarray:
        """Gaussian (out, in) matrix whose outputs have about ``gain`` x the input's RMS."""
        rng = self.rng(name)
        return (rng.standard_normal((n_out, n_in)) * (gain / np.sqrt(n_in))).astype(F32)

    def vector(self, name: str, n: int, mean: float, spread: float) -> np.ndarray:
        rng = self.rng(name)
        return (mean + spread * rng.standard_normal(n)).astype(F32)
