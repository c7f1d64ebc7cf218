"""A llama.cpp context built from a :class:`ContextSpec`, with checked low-level calls.

The fitter measures contexts built from the very same spec the engine later runs, so a
field added here changes both at once.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, TypeVar

import llama_cpp
import numpy as np
from llama_cpp import llama_cpp_ext

from shared.logs import get_logger
from worker.llm.backend import LlamaError, note_decode
from worker.llm.batch import Batch
from worker.llm.device_sampling import Draws, Greedy, KeyedChain, Shape, Top2Chain
from worker.llm.model import Model

#: How a sequence's rows are reduced on the device (:meth:`Context.sample_on_device`).
_How = TypeVar("_How", bound=bool | Greedy | Draws)

log = get_logger("llm")


@dataclass(frozen=True)
class ContextSpec:
    """Every context parameter specfleet sets; defaults are llama.cpp's unless noted."""

    n_ctx: int
    n_batch: int = 512
    n_ubatch: int = 512
    n_seq_max: int = 1
    n_rs_seq: int = 0
    #: Output rows per ubatch: a verify needs draft_max + 1, so capping it shrinks the
    #: compute buffer from ubatch x vocab (hundreds of MiB on a 262k vocab) to a few MiB.
    n_outputs_max: int = 0
    #: Output rows of one sequence per ubatch where a sequence is sampled on the device
    #: (:meth:`Context.sample_on_device`: llama.cpp refuses a decode past it; 0:
    #: n_outputs_max).
    n_outputs_max_per_seq: int = 0
    #: Every sequence is sampled on the device from creation (:meth:`Context.sample_on_device`):
    #: its chains are given to llama.cpp with the context, so the compute buffers they need
    #: are reserved (and measured by the fitter) then, not grown at a later decode.
    device_top2: bool = False
    n_threads: int = 0
    mtp: bool = False
    #: Full-size SWA cache is llama.cpp's default; off keeps only the window (Gemma: 6x less KV).
    swa_full: bool = False
    offload_kqv: bool = True
    #: One KV cache for every sequence (llama.cpp's ``kv_unified``; its default is a stream
    #: per sequence). A step's batch mixes sequences with different row counts (a verify of
    #: drafts beside plain rows, a prompt chunk beside decodes), and with a stream per
    #: sequence llama.cpp splits such a batch into equal-length ubatches, each reading every
    #: weight again: on Gemma 270M a verify of 8 rows over 4 slots cost two decodes. The
    #: price: a sequence's attention spans the cells of all (masked), so its logits can
    #: differ in the last bits with what else the cache holds (docs/engine.md, "Several
    #: slots").
    kv_unified: bool = True
    #: Width-invariant decoding (docs/engine.md, "Deterministic mode"): every row's logits
    #: are the same bits whatever else the decode carries. Per-sequence KV streams with a
    #: full sliding-window cache (a sequence's cells are its positions in order, whatever
    #: other sequences do), no flash attention (its CPU kernel has three paths chosen by the
    #: number of query rows and KV length), one ubatch per decode, and every sequence padded
    #: to an even row count (:meth:`Batch.pad_even`). The model must be loaded without
    #: repacked weights, which also turns tiled K-quant products off for the process
    #: (:func:`worker.llm.backend.require_width_invariant_kernels`).
    deterministic: bool = False
    #: An embedding context (llama.cpp's embeddings mode): every decoded row is an output and
    #: each sequence's rows are pooled into one vector (:meth:`Context.pooled`), by the
    #: model's own pooling (:attr:`Model.pooling`). llama.cpp still computes the logits of
    #: every row, so its compute and output buffers grow with the vocabulary times the batch.
    embeddings: bool = False

    def with_(self, **changes: object) -> ContextSpec:
        return replace(self, **changes)  # type: ignore[arg-type]

    def to_params(self) -> llama_cpp.llama_context_params:
        p = llama_cpp.llama_context_default_params()
        p.n_ctx = self.n_ctx
        p.n_batch = self.n_batch
        p.n_ubatch = min(self.n_ubatch, self.n_batch)
        p.n_seq_max = self.n_seq_max
        p.n_rs_seq = self.n_rs_seq
        p.n_outputs_max = self.n_outputs_max
        p.n_outputs_max_per_seq = self.n_outputs_max_per_seq
        if self.n_threads > 0:
            p.n_threads = self.n_threads
            p.n_threads_batch = self.n_threads
        p.ctx_type = (llama_cpp.LLAMA_CONTEXT_TYPE_MTP if self.mtp
                      else llama_cpp.LLAMA_CONTEXT_TYPE_DEFAULT)
        p.swa_full = self.swa_full
        p.offload_kqv = self.offload_kqv
        p.no_perf = True
        p.kv_unified = self.kv_unified
        p.embeddings = self.embeddings
        if self.deterministic:
            p.kv_unified = False
            p.swa_full = True
            p.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
            p.n_ubatch = self.n_batch
        return p


class Context:
    """Owns a ``llama_context`` over a :class:`Model`."""

    def __init__(self, model: Model, spec: ContextSpec) -> None:
        if spec.deterministic and model.spec.repack:
            raise LlamaError("a deterministic context needs the model loaded without "
                             "repacked weights (ModelSpec.repack=False)")
        if spec.mtp and not model.spec.load_mtp:
            # Creating an MTP context on a model loaded without load_mtp aborts the process
            # inside llama.cpp (GGML_ASSERT); refuse here instead.
            raise LlamaError("an MTP draft context needs the model loaded with load_mtp=True")
        params = spec.to_params()
        if spec.embeddings:
            params.pooling_type = model.pooling
        chains = ({seq: Top2Chain() for seq in range(spec.n_seq_max)} if spec.device_top2
                  else {})
        if chains:
            configs = (llama_cpp.llama_sampler_seq_config * len(chains))(
                *(llama_cpp.llama_sampler_seq_config(seq, ctypes.cast(top2.chain, ctypes.c_void_p))
                  for seq, top2 in chains.items()))
            params.samplers = configs
            params.n_samplers = len(chains)
        ptr = llama_cpp.llama_init_from_model(model.ptr, params)
        if not ptr:
            for top2 in chains.values():
                top2.free()
            what = "MTP draft context" if spec.mtp else "context"
            raise LlamaError(
                f"llama.cpp could not create the {what} (n_ctx={spec.n_ctx}, "
                f"n_rs_seq={spec.n_rs_seq}): out of memory or unsupported model"
            )
        self.model = model
        self.spec = spec
        self.ptr = ptr
        self.mem = llama_cpp.llama_get_memory(ptr)
        self._n_embd = model.n_embd
        # Row views are taken for every verified row and drafted token: with the array types
        # built once, a view is ~3x cheaper than np.ctypeslib.as_array, which rebuilds them.
        self._n_vocab = model.n_vocab
        self._logits_row = ctypes.c_float * self._n_vocab
        self._hidden_row = ctypes.c_float * model.n_embd
        #: Sequences sampled on the device (their top-2 chain), and what the last decode's
        #: rows of them said, read once each (:meth:`top2`).
        self._chains: dict[int, Top2Chain] = chains
        self._top2: dict[int, tuple[int, float]] = {}
        #: Sequences that draw on the device (their keyed chain), and the last decode's rows
        #: of them (batch indices: they have a sampled id and no logits).
        self._keyed: dict[int, KeyedChain] = {}
        self._keyed_rows: set[int] = set()
        #: Whether the output device runs a draw's ops, by the draw's shape (absent: not
        #: known until an attach).
        self._draws_run: dict[Shape, bool] = {}
        #: Logits rows read into Python (what the device path exists to avoid: a verify row of
        #: a 262k vocabulary is a megabyte copied off a GPU and reduced on the host).
        self.rows_read = 0

    @property
    def n_rs_seq(self) -> int:
        """Rollback snapshots per sequence actually granted (0 on architectures without)."""
        return int(llama_cpp.llama_n_rs_seq(self.ptr))

    def decode(self, batch: Batch) -> None:
        note_decode()
        self._top2.clear()
        self._keyed_rows.clear()
        pads = batch.pad_even() if self.spec.deterministic else []
        try:
            if self._keyed or self._chains:
                self._stage(batch)
            rc = llama_cpp.llama_decode(self.ptr, batch.raw)
            if rc != 0:
                raise LlamaError(f"llama_decode failed with code {rc} ({batch.n_tokens} tokens)")
            for chain in [*self._chains.values(), *self._keyed.values()]:
                chain.settle()
        finally:
            for seq, pos in pads:
                llama_cpp.llama_memory_seq_rm(self.mem, seq, pos, -1)
            batch.drop(len(pads))

    def _stage(self, batch: Batch) -> None:
        """Give each sequence that draws on the device the uniforms of its output rows in
        this batch (row at position p draws the token at p + 1), and each whose chain adjusts
        its logits their adjustments. A chain whose adjustments outgrew it is replaced by one
        with room (:meth:`_regrow`) before the decode, which then builds its graph anew."""
        chains: dict[int, KeyedChain | Top2Chain] = {
            seq: top2 for seq, top2 in self._chains.items() if top2.adjusting}
        chains.update(self._keyed)
        if not chains:
            return
        raw = batch.raw
        positions: dict[int, list[int]] = {seq: [] for seq in chains}
        outputs = np.ctypeslib.as_array(raw.logits, shape=(batch.n_tokens,))
        for row in np.flatnonzero(outputs).tolist():
            seq = raw.seq_id[row][0]
            mine = positions.get(seq)
            if mine is not None:
                mine.append(raw.pos[row] + 1)
                if seq in self._keyed:
                    self._keyed_rows.add(row)
        tokens: dict[int, dict[int, int]] = {seq: {} for seq, chain in chains.items()
                                             if chain.adjusting}
        if tokens:
            for row in range(batch.n_tokens):
                held = tokens.get(raw.seq_id[row][0])
                if held is not None:
                    held[raw.pos[row]] = raw.token[row]
        for seq, chain in chains.items():
            held = tokens.get(seq, {})
            need = chain.stage(positions[seq], held)
            if chain.adjusting and need > chain.adjusting.capacity:
                self._regrow(seq, chain, need).stage(positions[seq], held)

    def _regrow(self, seq: int, chain: KeyedChain | Top2Chain,
                need: int) -> KeyedChain | Top2Chain:
        """``seq``'s chain replaced by one of its kind whose rows' adjustments have room for
        ``need`` ids (rounded up to a power of two, so a growing history rebuilds the graph a
        few times, not at every new id)."""
        grown = chain.wider(1 << max(6, (need - 1).bit_length()))
        self._detach(seq)
        self._attach(seq, grown.chain, grown.free)
        if isinstance(grown, KeyedChain):
            self._keyed[seq] = grown
        else:
            self._chains[seq] = grown
        if not grown.supported:  # the same shape ran on this device a moment ago
            grown.settle()
            raise LlamaError(f"the output device refused a chain with room for {need} ids")
        return grown

    def synchronize(self) -> None:
        """Wait until the last decode has finished on the device.

        On an asynchronous backend (CUDA) ``llama_decode`` only queues the work and returns
        (llama.cpp leaves the wait to whoever reads the outputs), so a decode timed without
        this measures the kernel launches, not the compute. On the CPU backend the decode has
        finished already and this returns at once."""
        llama_cpp.llama_synchronize(self.ptr)

    def logits(self, row: int) -> np.ndarray:
        """Logits of output row ``row`` of the last decode (a view; copy to keep). Never a row
        of a sequence sampled on the device (:meth:`sample_on_device`): llama.cpp hands back its
        sampled buffer there, of which only the top two are valid."""
        ptr = llama_cpp.llama_get_logits_ith(self.ptr, row)
        if not ptr:
            raise LlamaError(f"no logits for output row {row}")
        self.rows_read += 1
        return _view(ptr, self._logits_row)

    def logits_rows(self, row0: int, n: int) -> np.ndarray:
        """Logits of ``n`` consecutive output rows from ``row0`` as one ``(n, n_vocab)`` view
        (llama.cpp keeps the outputs in batch order, so rows with logits are adjacent)."""
        first = llama_cpp.llama_get_logits_ith(self.ptr, row0)
        last = llama_cpp.llama_get_logits_ith(self.ptr, row0 + n - 1)
        if not first or not last:
            raise LlamaError(f"no logits for output rows {row0}..{row0 + n - 1}")
        n_vocab = self._n_vocab
        gap = ctypes.addressof(last.contents) - ctypes.addressof(first.contents)
        if gap != (n - 1) * n_vocab * ctypes.sizeof(ctypes.c_float):
            return np.stack([self.logits(row0 + i) for i in range(n)])
        self.rows_read += n
        return np.ctypeslib.as_array(first, shape=(n, n_vocab))

    def argmax(self, row: int) -> int:
        """Greedy token of output row ``row``: argmax straight on the view, no copy."""
        return int(np.argmax(self.logits(row)))

    def margins(self, row0: int, tokens: Sequence[int]) -> list[float]:
        """How far each token's logit led the best other one, at output rows ``row0..``
        (``tokens[i]`` at row ``row0 + i``; negative where another token led). Two max passes
        over slices of the view per row, no copy (0.04 ms a token on a 262k vocabulary); a
        row sampled on the device answers from its top two (:meth:`top2`: the committed token
        of such a row is its argmax); rows that drew on the device (:meth:`sampled`) have no
        logits here, so none is known (an empty list)."""
        if row0 in self._keyed_rows:
            return []
        out = []
        for i, token in enumerate(tokens):
            if row0 + i in self._top2:
                best, margin = self._top2[row0 + i]
                out.append(margin if token == best else -margin)
                continue
            z = self.logits(row0 + i)
            left, right = z[:token], z[token + 1:]
            rival = max(float(left.max()) if left.size else -np.inf,
                        float(right.max()) if right.size else -np.inf)
            out.append(float(z[token]) - rival)
        return out

    # -- device sampling ---------------------------------------------------------------------
    def sample_on_device(self, seq: int, how: _How) -> _How | Literal[False]:
        """How every output row of ``seq`` is reduced on the device from the next decode on:
        ``True``: to its two best tokens (a fresh
        :class:`~worker.llm.device_sampling.Top2Chain`: :meth:`top2` answers); a
        :class:`~worker.llm.device_sampling.Greedy`: to its two best tokens of the logits its
        penalties adjust; a :class:`~worker.llm.device_sampling.Draws`: to the token its
        uniforms draw (:meth:`sampled` answers); ``False``: not at all. Then no logits row of
        ``seq`` is copied to the host or read by Python. Returns ``how``, or False where the
        output device cannot run the chain's ops (the rows are then read).

        A change of kind (or of a draw's :class:`~worker.llm.device_sampling.Shape`: its top-k
        cut, the size of an op in its graph, a nucleus or none, penalties or none) costs the
        next decode a graph rebuild (~18 ms on a 2-core CPU), so a sequence keeps its chain
        while its requests can use it (new draws of the same shape, or new penalties, for a
        sequence that has such a chain already are only new inputs). llama.cpp aborts on a
        chain attached twice or a bare sampler, and never frees one: each attach builds its
        own chain, which is freed once detached."""
        top2 = self._chains.get(seq)
        if top2 is not None and (how is True and not top2.adjusting):
            return how
        if top2 is not None and isinstance(how, Greedy) and top2.adjusting:
            top2.adjusting.source = how.penalties
            return how
        keyed = self._keyed.get(seq)
        draws = how if not isinstance(how, bool | Greedy) else None
        if draws is not None and keyed is not None and keyed.shape == Shape.of(draws):
            keyed.redraw(draws)
            return how
        self._detach(seq)
        if how is False or (draws is not None and self._draws_run.get(Shape.of(draws)) is False):
            return False
        chain: Top2Chain | KeyedChain
        if draws is None:
            chain = Top2Chain(how.penalties, self._n_vocab) if isinstance(how, Greedy) \
                else Top2Chain()
            self._attach(seq, chain.chain, chain.free)
            self._chains[seq] = chain
            if how is True:
                return how  # the context was made to carry it (``ContextSpec.device_top2``)
        else:
            chain = KeyedChain(draws, self._n_vocab)
            self._attach(seq, chain.chain, chain.free)
            self._keyed[seq] = chain
            self._draws_run[chain.shape] = chain.supported
        if chain.supported:
            return how
        self._detach(seq)
        chain.settle()  # a failed probe is raised, not taken for a missing op
        log.warning("device_sampling.unsupported", seq=seq, reason=chain.refusal)
        return False

    def _attach(self, seq: int, chain: Any, free: Callable[[], None]) -> None:
        """Give ``seq`` the sampler ``chain``; where llama.cpp refuses it, ``free`` it and
        raise."""
        if not llama_cpp.llama_set_sampler(self.ptr, seq, chain):
            free()
            raise LlamaError(f"llama.cpp refused a device sampler for sequence {seq}")

    def _detach(self, seq: int) -> None:
        """Take ``seq``'s chain (either kind) off the context, and free it."""
        chain = self._chains.pop(seq, None)
        keyed = self._keyed.pop(seq, None)
        if chain is None and keyed is None:
            return
        llama_cpp.llama_set_sampler(self.ptr, seq, None)
        if chain is not None:
            chain.free()
        if keyed is not None:
            keyed.free()

    def sampled(self, row: int) -> int:
        """The token output row ``row`` drew on the device (a sequence given
        :class:`~worker.llm.device_sampling.Draws`)."""
        token = int(llama_cpp.llama_get_sampled_token_ith(self.ptr, row))
        if row not in self._keyed_rows or token < 0:
            raise LlamaError(f"output row {row} did not draw on the device")
        return token

    def top2(self, row: int) -> tuple[int, float]:
        """The argmax of output row ``row`` of a sequence sampled on the device, and its lead
        over the runner-up: read from the two candidates llama.cpp kept (their order is not
        the logits', so the larger logit wins, the lower id on a tie, as ``np.argmax``)."""
        found = self._top2.get(row)
        if found is not None:
            return found
        if llama_cpp.llama_get_sampled_candidates_count_ith(self.ptr, row) != 2:
            raise LlamaError(f"output row {row} was not sampled on the device")
        ids = llama_cpp.llama_get_sampled_candidates_ith(self.ptr, row)
        logits = llama_cpp.llama_get_sampled_logits_ith(self.ptr, row)
        if not ids or not logits:
            raise LlamaError(f"no device samples for output row {row}")
        a, b = (0, 1) if (logits[0], -ids[0]) >= (logits[1], -ids[1]) else (1, 0)
        found = self._top2[row] = (int(ids[a]), float(logits[a] - logits[b]))
        return found

    # -- pooled embeddings (an embedding context) -------------------------------------------
    def pooled(self, seq: int) -> np.ndarray:
        """The pooled vector of sequence ``seq`` in the last decode of an embedding context
        (``n_embd_out`` floats, a view; copy to keep)."""
        ptr = llama_cpp.llama_get_embeddings_seq(self.ptr, seq)
        if not ptr:
            raise LlamaError(f"no pooled embedding for sequence {seq}: not an embedding "
                             "context, or the sequence was not in the last decode")
        return np.ctypeslib.as_array(ptr, shape=(self.model.n_embd_out,))

    # -- hidden states (MTP hand-over) -----------------------------------------------------
    def expose_hidden(self, masked: bool) -> None:
        """Make every decode publish its NextN hidden rows (``masked``: only rows with logits).

        The target exposes all rows (the draft needs the hidden state of every accepted
        position); the MTP draft context only its output rows.
        """
        llama_cpp_ext.llama_set_embeddings_nextn(self.ptr, True, masked)

    def hidden_rows(self, n: int, start: int = 0) -> np.ndarray:
        """The last decode's hidden rows of batch entries ``start..start+n`` (a view; copy to
        keep). Unmasked rows are stored in batch order, one per entry."""
        ptr = llama_cpp_ext.llama_get_embeddings_nextn(self.ptr)
        if not ptr:
            raise LlamaError("no hidden rows: the context does not expose NextN embeddings")
        return np.ctypeslib.as_array(ptr, shape=(start + n, self._n_embd))[start:]

    def hidden(self, row: int) -> np.ndarray:
        """Hidden row of output row ``row`` of the last decode (a view; copy to keep)."""
        ptr = llama_cpp_ext.llama_get_embeddings_nextn_ith(self.ptr, row)
        if not ptr:
            raise LlamaError(f"no hidden row for output row {row}")
        return _view(ptr, self._hidden_row)

    # -- memory ----------------------------------------------------------------------------
    def seq_rm(self, p0: int, p1: int = -1, seq: int = 0) -> bool:
        """Remove positions [p0, p1) of ``seq``; False means nothing was removed."""
        return bool(llama_cpp.llama_memory_seq_rm(self.mem, seq, p0, p1))

    def clear(self) -> None:
        llama_cpp.llama_memory_clear(self.mem, True)

    def seq_clear(self, seq: int) -> None:
        """Drop every position of ``seq`` (a slot handed to the next request); the other
        sequences are untouched."""
        if not llama_cpp.llama_memory_seq_rm(self.mem, seq, -1, -1):
            raise LlamaError(f"llama.cpp refused to clear sequence {seq}")

    def pos_max(self, seq: int = 0) -> int:
        return int(llama_cpp.llama_memory_seq_pos_max(self.mem, seq))

    def pos_min(self, seq: int = 0) -> int:
        """Smallest position ``seq`` still holds (a sliding-window cache drops old ones;
        -1: the sequence is empty)."""
        return int(llama_cpp.llama_memory_seq_pos_min(self.mem, seq))

    # -- state -----------------------------------------------------------------------------
    def state_size(self, flags: int, seq: int = 0) -> int:
        return int(llama_cpp.llama_state_seq_get_size_ext(self.ptr, seq, flags))

    def state_save(self, buf: ctypes.Array, flags: int, seq: int = 0) -> int:
        """Write the sequence state into ``buf``; returns bytes written (0 = failure)."""
        return int(llama_cpp.llama_state_seq_get_data_ext(
            self.ptr, ctypes.cast(buf, ctypes.POINTER(ctypes.c_uint8)), len(buf), seq, flags))

    def state_restore(self, buf: ctypes.Array, size: int, flags: int, seq: int = 0) -> int:
        """Restore a state saved with the same ``flags``; returns bytes read (0 = failure)."""
        return int(llama_cpp.llama_state_seq_set_data_ext(
            self.ptr, ctypes.cast(buf, ctypes.POINTER(ctypes.c_uint8)), size, seq, flags))

    def close(self) -> None:
        if self.ptr:
            llama_cpp.llama_free(self.ptr)
            self.ptr = None
            for top2 in self._chains.values():  # llama.cpp never frees an attached chain
                top2.free()
            self._chains.clear()
            for keyed in self._keyed.values():
                keyed.free()
            self._keyed.clear()

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _view(ptr: ctypes._Pointer, row_type: type[ctypes.Array]) -> np.ndarray:
    """A float32 view (no copy) of the ``row_type``-sized array ``ptr`` points at.

    The memoryview is only for numpy's stubs, which do not list ctypes arrays as buffers.
    """
    row = row_type.from_address(ctypes.addressof(ptr.contents))
    return np.frombuffer(memoryview(row), dtype=np.float32)
