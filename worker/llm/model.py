"""A loaded GGUF model and what the engine and fitter need to know about it."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import llama_cpp

from shared.logs import get_logger
from worker.llm.backend import LlamaError, init_backend, require_width_invariant_kernels
from worker.llm.devices import has_local_gpu
from worker.llm.placement import active_placement

log = get_logger("llm")


@cache
def repacking_is_safe() -> bool:
    """Whether llama.cpp may keep repacked copies of the weights ("extra buffer types").

    Not on a CPU with AMX: this llama.cpp's AMX buffer segfaults in the first decode of Gemma
    3 270M Q4_K_M (its own high-level ``Llama`` too), and it doubles the weights' memory (a
    repacked copy beside the mapped file: 449 MiB instead of 235). Without it the same build
    decodes the same model normally, and the fitter measures the same weights on every CPU.
    """
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True
    safe = "amx_int8" not in flags
    if not safe:
        log.info("llm.weight_repack_off", reason="cpu_has_amx")
    return safe


@dataclass(frozen=True)
class ModelSpec:
    """How to load a model. ``no_alloc`` loads metadata only (the fitter's dry run)."""

    path: str
    load_mtp: bool = False
    n_gpu_layers: int = 0
    main_gpu: int = 0
    no_alloc: bool = False
    #: Let llama.cpp keep repacked copies of the weights where the CPU has kernels for them
    #: (Q4_K on AVX2: a 4-row gemm and a 1-row gemv that round differently, chosen per
    #: product by its row count). Off for deterministic mode, which also needs the process's
    #: tiled K-quant products off: loading such a model turns them off, or refuses once a
    #: decode has run (:func:`~worker.llm.backend.require_width_invariant_kernels`).
    repack: bool = True


class Model:
    """Owns a ``llama_model``; free it with :meth:`close` (or use as a context manager)."""

    def __init__(self, spec: ModelSpec) -> None:
        init_backend()
        if not spec.repack:
            require_width_invariant_kernels()
        path = Path(spec.path)
        if not path.is_file():
            raise LlamaError(f"model file not found: {spec.path}")
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = spec.n_gpu_layers
        params.main_gpu = spec.main_gpu
        params.load_mtp = spec.load_mtp
        params.use_extra_bufts = spec.repack and repacking_is_safe()
        if spec.no_alloc:
            # no_alloc aborts inside llama.cpp unless mmap/mlock loading is off too.
            params.no_alloc = True
            params.load_mode = llama_cpp.LLAMA_LOAD_MODE_NONE
        placement = active_placement() if spec.n_gpu_layers != 0 else None
        #: The device group's arrays, alive until llama.cpp has copied them (the load).
        keep = placement.apply(params) if placement is not None else ()
        ptr = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        del keep
        if not ptr:
            raise LlamaError(f"llama.cpp could not load the model {spec.path} (not a valid GGUF?)")
        self.spec = spec
        self.ptr = ptr
        self.vocab = llama_cpp.llama_model_get_vocab(ptr)
        self._n_vocab = int(llama_cpp.llama_vocab_n_tokens(self.vocab))
        #: :meth:`is_eog` per token asked so far: the suffix drafter asks of every token it
        #: walks, and each answer from llama.cpp is a foreign call (~1.5 us).
        self._eog: dict[int, bool] = {}

    # -- facts -----------------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        return self._n_vocab

    @property
    def n_embd(self) -> int:
        return int(llama_cpp.llama_model_n_embd(self.ptr))

    @property
    def n_embd_out(self) -> int:
        """Width of the model's output embedding: a pooled vector's dimension."""
        return int(llama_cpp.llama_model_n_embd_out(self.ptr))

    @property
    def pooling(self) -> int:
        """How an embedding context pools a sequence's rows (a ``LLAMA_POOLING_TYPE_*``):
        the pooling the GGUF declares (an embedding model's mean, CLS or last token), else
        the mean. A generative model declares none; llama-server then refuses
        ``/v1/embeddings`` (no pooling), where the mean of the final hidden states is the
        usual sentence embedding (sentence-transformers' default)."""
        declared = self._meta(f"{self._meta('general.architecture')}.pooling_type")
        pooled = (llama_cpp.LLAMA_POOLING_TYPE_MEAN, llama_cpp.LLAMA_POOLING_TYPE_CLS,
                  llama_cpp.LLAMA_POOLING_TYPE_LAST)
        if declared.isdigit() and int(declared) in pooled:
            return int(declared)
        return llama_cpp.LLAMA_POOLING_TYPE_MEAN

    def _meta(self, key: str) -> str:
        """A GGUF metadata value as text ('' when the file has no such key)."""
        buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace") if n > 0 else ""

    @property
    def n_layer(self) -> int:
        return int(llama_cpp.llama_model_n_layer(self.ptr))

    @property
    def n_layer_nextn(self) -> int:
        """NextN (MTP) layers in the GGUF; reported even when loaded without ``load_mtp``."""
        return int(llama_cpp.llama_model_n_layer_nextn(self.ptr))

    @property
    def has_mtp_head(self) -> bool:
        return self.n_layer_nextn > 0

    @property
    def n_ctx_train(self) -> int:
        return int(llama_cpp.llama_model_n_ctx_train(self.ptr))

    @property
    def is_recurrent(self) -> bool:
        """True when the model carries recurrent state (pure recurrent or hybrid)."""
        return bool(llama_cpp.llama_model_is_recurrent(self.ptr)) or bool(
            llama_cpp.llama_model_is_hybrid(self.ptr)
        )

    @property
    def offloaded(self) -> bool:
        """Whether its layers run on a GPU: some were asked for (``n_gpu_layers``) and this
        llama.cpp build has a GPU backend to put them on (a CPU build ignores the request).
        There a decode that repeats the previous one's shape replays its CUDA graph, so a
        plain step costs about half of what the same row costs after a verify. Layers on
        RPC devices do not count: llama.cpp's RPC backend makes a build "offload" without a
        GPU of its own, and what the remote end runs is not this process's to know."""
        return self.spec.n_gpu_layers != 0 and has_local_gpu()

    @property
    def n_swa(self) -> int:
        """Sliding-window width of the model's SWA layers (0: no sliding window)."""
        return int(llama_cpp.llama_model_n_swa(self.ptr))

    @property
    def size_bytes(self) -> int:
        """Bytes of all weight tensors, as llama.cpp counts them."""
        return int(llama_cpp.llama_model_size(self.ptr))

    # -- tokens ----------------------------------------------------------------------------
    def is_eog(self, token: int) -> bool:
        found = self._eog.get(token)
        if found is None:
            found = self._eog[token] = bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))
        return found

    def tokenize(self, text: str, add_special: bool = True,
                 parse_special: bool = False) -> list[int]:
        """Token ids of ``text``; ``parse_special`` turns special-token text into those tokens
        (only for text a model's own template wrote, never for user text)."""
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special,
                                     parse_special)
        if n < 0:
            cap = -n
            buf = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special,
                                         parse_special)
        if n < 0:
            raise LlamaError("tokenization failed")
        return list(buf[:n])

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        """Raw bytes of one token's piece (may be part of a multi-byte UTF-8 character);
        ``special`` renders control tokens' text too (a grammar's view of the vocabulary)."""
        self._check_token(token)
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        return buf.raw[: max(n, 0)]

    def is_control(self, token: int) -> bool:
        """A control token (turn markers, BOS/EOS): text can never spell it."""
        self._check_token(token)
        attr = llama_cpp.llama_vocab_get_attr(self.vocab, token)
        return bool(attr & llama_cpp.LLAMA_TOKEN_ATTR_CONTROL)

    def _check_token(self, token: int) -> None:
        """Refuse an id outside the vocabulary: llama.cpp looks a token's attributes up with
        ``std::vector::at``, whose exception no C caller catches, so such an id would abort
        the process (every slot of the worker) where this fails only the caller."""
        if not 0 <= token < self._n_vocab:
            raise LlamaError(f"token {token} is not in this model's vocabulary of "
                             f"{self._n_vocab}")

    @property
    def eos(self) -> int | None:
        """The end-of-sequence token (None: the vocabulary has none)."""
        token = int(llama_cpp.llama_vocab_eos(self.vocab))
        return token if 0 <= token < self.n_vocab else None

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", errors="replace")

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        if self.ptr:
            llama_cpp.llama_model_free(self.ptr)
            self.ptr = None

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
