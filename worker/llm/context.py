"""A llama.cpp context built from a :class:`ContextSpec`, with checked low-level calls.

The fitter measures contexts built from the very same spec the engine later runs, so a
field added here changes both at once.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass, replace

import llama_cpp
import numpy as np
from llama_cpp import llama_cpp_ext

from worker.llm.backend import LlamaError, note_decode
from worker.llm.batch import Batch
from worker.llm.model import Model


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
        if self.n_threads > 0:
            p.n_threads = self.n_threads
            p.n_threads_batch = self.n_threads
        p.ctx_type = (llama_cpp.LLAMA_CONTEXT_TYPE_MTP if self.mtp
                      else llama_cpp.LLAMA_CONTEXT_TYPE_DEFAULT)
        p.swa_full = self.swa_full
        p.offload_kqv = self.offload_kqv
        p.no_perf = True
        p.kv_unified = self.kv_unified
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
        ptr = llama_cpp.llama_init_from_model(model.ptr, spec.to_params())
        if not ptr:
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

    @property
    def n_rs_seq(self) -> int:
        """Rollback snapshots per sequence actually granted (0 on architectures without)."""
        return int(llama_cpp.llama_n_rs_seq(self.ptr))

    def decode(self, batch: Batch) -> None:
        note_decode()
        pads = batch.pad_even() if self.spec.deterministic else []
        try:
            rc = llama_cpp.llama_decode(self.ptr, batch.raw)
            if rc != 0:
                raise LlamaError(f"llama_decode failed with code {rc} ({batch.n_tokens} tokens)")
        finally:
            for seq, pos in pads:
                llama_cpp.llama_memory_seq_rm(self.mem, seq, pos, -1)
            batch.drop(len(pads))

    def synchronize(self) -> None:
        """Wait until the last decode has finished on the device.

        On an asynchronous backend (CUDA) ``llama_decode`` only queues the work and returns
        (llama.cpp leaves the wait to whoever reads the outputs), so a decode timed without
        this measures the kernel launches, not the compute. On the CPU backend the decode has
        finished already and this returns at once."""
        llama_cpp.llama_synchronize(self.ptr)

    def logits(self, row: int) -> np.ndarray:
        """Logits of output row ``row`` of the last decode (a view; copy to keep)."""
        ptr = llama_cpp.llama_get_logits_ith(self.ptr, row)
        if not ptr:
            raise LlamaError(f"no logits for output row {row}")
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
        return np.ctypeslib.as_array(first, shape=(n, n_vocab))

    def argmax(self, row: int) -> int:
        """Greedy token of output row ``row``: argmax straight on the view, no copy."""
        return int(np.argmax(self.logits(row)))

    def margins(self, row0: int, tokens: Sequence[int]) -> list[float]:
        """How far each token's logit led the best other one, at output rows ``row0..``
        (``tokens[i]`` at row ``row0 + i``; negative where another token led). Two max passes
        over slices of the view per row, no copy (0.04 ms a token on a 262k vocabulary)."""
        out = []
        for i, token in enumerate(tokens):
            z = self.logits(row0 + i)
            left, right = z[:token], z[token + 1:]
            rival = max(float(left.max()) if left.size else -np.inf,
                        float(right.max()) if right.size else -np.inf)
            out.append(float(z[token]) - rival)
        return out

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
