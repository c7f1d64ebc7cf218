"""Structured random weights that make a tiny model's greedy decoding worth speculating on.

Plain Gaussian weights give a model whose next token no drafter can guess (~0% acceptance),
which leaves rollback and telemetry untested. Every tiny model therefore shares one skeleton:

* Tokens are the elements ``(c, i)`` of the group Z32 x Z8 (shuffled to ids). Their embeddings
  live in three disjoint sets of dimensions: a random "Fourier" embedding of the group (the
  *token* subspace), one constant dimension (a bias the blocks can threshold against), and a
  *scratch* subspace that the output layer ignores.
* The output layer predicts ``perm(c, i) = (c, i + 1)``: a hidden state close to ``E[t]``
  scores ``perm(t)`` at ``logit_scale``, far above every other token.
* Attention and delta-net blocks read the whole stream and write only into scratch, so they
  record the context without moving the prediction.
* The last trunk block's feed-forward is a *switch*: when a scratch direction exceeds a
  threshold it adds ``alpha * J x`` where ``J`` is the group shift ``(c, i) -> (c + 8, i)``
  (an exact rotation of the Fourier embedding), sending greedy to ``perm(J t)`` instead.
  A steep gate makes the switch nearly binary, so greedy top-1/top-2 margins stay wide.

The MTP head has no switch: it predicts ``perm`` and is right whenever the switch is off.
Gemma's blocks RMS-normalise their outputs (post-norms), so there the post-norm weights size
what each block adds, and the switch gets an "off" unit (see :meth:`Recipe.switch`).
Jumps stay within four cycles of eight tokens, so greedy text revisits the same n-grams.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

F32 = np.float32

N_CYCLES = 32
CYCLE_LEN = 8
JUMP = 8  # the switch moves (c, i) to (c + JUMP, i): four reachable cycles per start
TOKEN_PLANES = 24  # the token subspace is 2 x 24 = 48 dimensions
CONST_DIM = 2 * TOKEN_PLANES
SCRATCH = slice(CONST_DIM + 1, None)
CONST_VALUE = 2.0
CANDIDATE_EMBEDDINGS = 8  # frequency sets tried; the least self-similar one is kept


@dataclass(frozen=True)
class Dims:
    """Shapes shared by every tiny model (numpy arrays are (out, in): ggml's order reversed)."""

    n_vocab: int = N_CYCLES * CYCLE_LEN
    n_embd: int = 64
    n_head: int = 2
    n_head_kv: int = 1
    head_dim: int = 32
    n_ff: int = 128


@dataclass(frozen=True)
class Strengths:
    """Knobs of the recipe; the defaults give ~50% MTP acceptance at draft width 4 (seed 0).

    How often the switch fires depends on the seed's random context writers, so other seeds
    land anywhere between ~25% and ~70% MTP acceptance: tests that need exact figures use seed 0.
    """

    #: logit of ``perm(t)`` when the hidden state is exactly ``E[t]``.
    logit_scale: float = 40.0
    #: gain of the context writers (attention, delta-net, plain feed-forward) into scratch.
    context: float = 1.0
    #: gain of attention queries and keys (sharper attention keeps the context varied).
    sharpness: float = 3.0
    #: switch fires when the scratch probe exceeds this (in units of the stream's RMS).
    threshold: float = 1.2
    #: steepness of the switch gate; higher means fewer near-ties.
    gate: float = 40.0
    #: size of the jump the switch adds, relative to the token's own embedding.
    jump: float = 4.0


class Recipe:
    """Deterministic weight factory: the same ``seed`` and component name give the same array.

    Each component draws from its own generator keyed by (seed, name), so the head-less twin
    of the hybrid model gets byte-identical trunk weights without replaying the MTP draws.
    """

    def __init__(self, seed: int, dims: Dims = Dims(), strengths: Strengths = Strengths()) -> None:
        self.seed = seed
        self.dims = dims
        self.strengths = strengths
        ids = self.rng("token ids").permutation(dims.n_vocab)  # group element -> token id
        cycle, step = np.divmod(np.arange(dims.n_vocab), CYCLE_LEN)
        self._group = (cycle, step)
        self.perm = np.empty(dims.n_vocab, dtype=np.int64)
        self.perm[ids] = ids[cycle * CYCLE_LEN + (step + 1) % CYCLE_LEN]
        self.jump = np.empty(dims.n_vocab, dtype=np.int64)
        self.jump[ids] = ids[((cycle + JUMP) % N_CYCLES) * CYCLE_LEN + step]
        self._freqs = self._least_similar_frequencies()
        embd = np.zeros((dims.n_vocab, dims.n_embd))
        embd[ids, :CONST_DIM] = self._fourier(self._freqs)
        embd[:, CONST_DIM] = CONST_VALUE
        self.embd = embd.astype(F32)

    @property
    def token_norm(self) -> float:
        """Length of every embedding's token part (the Fourier planes)."""
        return float(np.sqrt(self.dims.n_embd - CONST_VALUE**2))

    def rng(self, name: str) -> np.random.Generator:
        return np.random.default_rng([self.seed, *name.encode()])

    # -- the token embedding -----------------------------------------------------------------
    def _fourier(self, freqs: tuple[np.ndarray, np.ndarray, np.ndarray]) -> np.ndarray:
        """Group elements as rotations: plane b turns by 2pi (m_b i / 8 + n_b c / 32)."""
        m, n, phase = freqs
        cycle, step = self._group
        angle = phase + 2 * np.pi * (np.outer(step, m) / CYCLE_LEN + np.outer(cycle, n) / N_CYCLES)
        radius = np.sqrt((self.dims.n_embd - CONST_VALUE**2) / TOKEN_PLANES)  # RMS 1 overall
        planes = np.stack([np.cos(angle), np.sin(angle)], axis=-1) * radius
        return planes.reshape(self.dims.n_vocab, CONST_DIM)

    def _least_similar_frequencies(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Draw a few frequency sets and keep the one whose tokens are least alike.

        The margin of ``perm(t)`` over the runner-up is ``1 - max cosine`` between embeddings.
        """
        rng = self.rng("frequencies")
        best, best_sim = None, np.inf
        for _ in range(CANDIDATE_EMBEDDINGS):
            freqs = (rng.integers(0, CYCLE_LEN, TOKEN_PLANES),
                     rng.integers(0, N_CYCLES, TOKEN_PLANES),
                     rng.uniform(0, 2 * np.pi, TOKEN_PLANES))
            e = self._fourier(freqs)
            gram = e @ e.T
            np.fill_diagonal(gram, -np.inf)
            sim = gram.max() / (e[0] @ e[0])
            if sim < best_sim:
                best, best_sim = freqs, sim
        assert best is not None
        return best

    def jump_map(self) -> np.ndarray:
        """The linear map on the token subspace with ``J E[t] = E[jump(t)]`` exactly."""
        _, n, _ = self._freqs
        j = np.zeros((CONST_DIM, CONST_DIM))
        for b, angle in enumerate(2 * np.pi * n * JUMP / N_CYCLES):
            c, s = np.cos(angle), np.sin(angle)
            j[2 * b:2 * b + 2, 2 * b:2 * b + 2] = [[c, -s], [s, c]]
        return j

    # -- the skeleton ----------------------------------------------------------------------
    def token_embd(self) -> np.ndarray:
        return self.embd

    def output(self) -> np.ndarray:
        """Row ``v`` reads the token subspace for ``E[perm^-1(v)]``; scratch is ignored."""
        inverse = np.argsort(self.perm)
        rows = self.embd[inverse].copy()
        rows[:, CONST_DIM:] = 0.0
        norm2 = float(rows[0] @ rows[0])
        return (rows * (self.strengths.logit_scale / norm2)).astype(F32)

    def switch(self, name: str, post_normed: bool = False, probe_dim: int | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(gate, up, down) of the feed-forward switch; see the module docstring.

        ``probe_dim`` makes the probe one scratch dimension instead of a random direction, so
        each gate input is a sum of two products only (probe and threshold), which every
        matmul kernel rounds alike (see :meth:`sparse`).

        ``post_normed`` is for blocks whose output is RMS-normalised before the residual add
        (Gemma's ``ffn_post_norm``): there the output's size is fixed, so "off" cannot mean
        "output ~0". One more unit, gated the opposite way, then writes the constant dimension
        (which the output layer ignores) instead, and the normalised output points either at
        ``J x`` (on) or at the constant dimension (off); :meth:`switch_post_norm` sizes it.
        """
        d, s = self.dims, self.strengths
        if probe_dim is None:
            probe = self.rng(name).standard_normal(d.n_embd - CONST_DIM - 1)
            probe /= np.linalg.norm(probe)
        else:
            probe = np.eye(d.n_embd - CONST_DIM - 1)[probe_dim]
        gate = np.zeros((d.n_ff, d.n_embd))
        gate[:CONST_DIM, SCRATCH] = s.gate * probe
        gate[:CONST_DIM, CONST_DIM] = -s.gate * s.threshold / CONST_VALUE
        up = np.zeros((d.n_ff, d.n_embd))
        up[:CONST_DIM, :CONST_DIM] = np.eye(CONST_DIM)
        down = np.zeros((d.n_embd, d.n_ff))
        down[:CONST_DIM, :CONST_DIM] = (1.0 if post_normed else s.jump) * self.jump_map()
        if post_normed:
            off = CONST_DIM  # the first unit after the 48 token units
            gate[off] = -gate[0]
            # as large as the token units' output, so neither side wins near the threshold
            up[off, CONST_DIM] = self.token_norm / CONST_VALUE
            down[CONST_DIM, off] = 1.0
        return gate.astype(F32), up.astype(F32), down.astype(F32)

    # -- post-norm weights (blocks that RMS-normalise their output: Gemma) ------------------
    # A post-normed block adds an output of RMS 1 (times these weights) to a stream of RMS
    # ``stream_rms`` (Gemma scales embeddings by sqrt(n_embd)), whatever the block computed;
    # the weights give each part the size, relative to the stream, a pre-norm block gives it.
    def context_post_norm(self, stream_rms: float) -> np.ndarray:
        """Post-norm weights of a context writer (attention, plain feed-forward)."""
        d = self.dims
        w = np.zeros(d.n_embd)
        w[SCRATCH] = self.strengths.context * np.sqrt((d.n_embd - CONST_DIM - 1) / d.n_embd)
        return (w * stream_rms).astype(F32)

    def switch_post_norm(self, stream_rms: float) -> np.ndarray:
        """Post-norm weights of the ``post_normed`` switch: on, it adds ``jump`` times the
        stream's token part along ``J``; off, one stream RMS to the constant dimension."""
        w = np.zeros(self.dims.n_embd)
        w[:CONST_DIM] = self.strengths.jump * self.token_norm / np.sqrt(self.dims.n_embd)
        w[CONST_DIM] = 1.0
        return (w * stream_rms).astype(F32)

    # -- generic parts ---------------------------------------------------------------------
    @staticmethod
    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=F32)

    def matrix(self, name: str, n_out: int, n_in: int, gain: float = 1.0) -> np.ndarray:
        """Gaussian (out, in) matrix whose outputs have about ``gain`` x the input's RMS."""
        rng = self.rng(name)
        return (rng.standard_normal((n_out, n_in)) * (gain / np.sqrt(n_in))).astype(F32)

    def to_scratch(self, name: str, n_in: int, gain: float | None = None) -> np.ndarray:
        """An output projection that writes only into the scratch subspace."""
        out = np.zeros((self.dims.n_embd, n_in), dtype=F32)
        n_scratch = self.dims.n_embd - CONST_DIM - 1
        g = self.strengths.context if gain is None else gain
        out[SCRATCH] = self.matrix(name, n_scratch, n_in, g)
        return out

    def sparse(self, name: str, n_out: int, n_in: int, rows: np.ndarray, columns: np.ndarray,
               gain: float = 1.0) -> np.ndarray:
        """An (out, in) matrix whose row ``rows[j]`` reads only column ``columns[j]``.

        With one nonzero weight per row, each output is a single rounded product, whatever
        order a kernel sums in: batched gemm and one-row gemv give the same bits, so a model
        built from such matrices is batch-invariant (dense ones differ in the last bits, which
        F16 roundings downstream, K/V cache and ggml's GELU table, can turn into jumps).
        Weights are ``gain`` times a random sign times a magnitude in [0.5, 1.5).
        """
        rng = self.rng(name)
        out = np.zeros((n_out, n_in))
        magnitude = rng.uniform(0.5, 1.5, len(rows)) * rng.choice([-1.0, 1.0], len(rows))
        out[rows, columns] = gain * magnitude
        return out.astype(F32)

    def vector(self, name: str, n: int, mean: float, spread: float) -> np.ndarray:
        rng = self.rng(name)
        return (mean + spread * rng.standard_normal(n)).astype(F32)
