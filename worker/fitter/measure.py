"""Measure, don't guess: every figure the fit adds up comes from llama.cpp itself.

- Contexts are created for real over a ``no_alloc`` model: llama.cpp sizes their KV cache,
  recurrent buffers and compute buffers exactly as it would for the engine (the compute
  estimate equals the real allocation on one device; over a group it can exceed it on a
  later device, docs/fitter.md) without allocating the KV or compute memory. Every figure
  is kept per device (:class:`~worker.fitter.buffers.DeviceMap`).
- Weights come from llama.cpp's model buffers on a CPU worker (a memory-mapped load: the
  ``CPU_REPACK`` copies are real extra memory that ``llama_model_size`` does not count) and
  over a device group (a real load on the group: per device, no other way), and from
  ``llama_model_size`` on one GPU, where no_alloc reports no per-buffer sizes.
- One recurrent-state group (one rollback snapshot, one device checkpoint's payload) comes
  from the state-size API on a small real context: ``PARTIAL_ONLY`` is the checkpoint with
  its payload, ``PARTIAL_ONLY | ON_DEVICE`` the same without it; the difference is exact.
- The output buffer grows after creation, when a decode asks for more output rows (and, on
  an MTP target, when it hands over a hidden row for every batch entry). llama.cpp does not
  log that growth, so it is computed with llama.cpp's own sizing rule (``output_reserve``)
  from the model's vocabulary and embedding width.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import llama_cpp

from worker.engine.prefix_cache import checkpoint_bytes
from worker.fitter.buffers import Buffers, DeviceMap, parse_buffers
from worker.fitter.errors import FitError
from worker.llm import Batch, Context, ContextSpec, LlamaError, Model, ModelSpec, capture_llama_log

_PARTIAL = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
_ON_DEVICE = llama_cpp.LLAMA_STATE_SEQ_FLAGS_ON_DEVICE
_FLOAT = 4
#: The small real context the state sizes are read from.
_PROBE_CTX = 256


@dataclass(frozen=True)
class ContextMemory:
    """One context's memory, in bytes per place (:attr:`DeviceMap.places`), as llama.cpp
    sized it."""

    kv: dict[str, int]
    #: llama.cpp's recurrent buffers, as logged.
    recurrent: dict[str, int]
    #: Recurrent layers per place: how one exact recurrent group divides between them.
    recurrent_layers: Counter[str]
    compute: dict[str, int]
    #: Output buffer at creation (logged by llama.cpp) and once decodes have grown it: host
    #: memory (:attr:`DeviceMap.host`).
    output_created: int
    output_runtime: int

    @property
    def recurrent_total(self) -> int:
        return sum(self.recurrent.values())


@dataclass(frozen=True)
class StateSizes:
    """Exact bytes of one sequence's recurrent state, from the state-size API."""

    #: One recurrent-state group: a rollback snapshot, or a device checkpoint's payload.
    group: int
    #: A host checkpoint: the group plus llama.cpp's header, copied into host memory.
    host_checkpoint: int


def load_model(spec: ModelSpec) -> tuple[Model, Buffers]:
    """Load ``spec`` and return it with the model buffers llama.cpp reported for it."""
    try:
        with capture_llama_log() as lines:
            model = Model(spec)
    except LlamaError as exc:
        raise FitError(f"cannot measure the model: {exc}") from exc
    return model, parse_buffers(lines)


def weights_bytes(model: Model, buffers: Buffers | None, where: DeviceMap) -> dict[str, int]:
    """The weights per place: llama.cpp's model buffers when they were really allocated (a
    CPU worker's memory-mapped load, a group's real load), else (one GPU, metadata only)
    ``llama_model_size``, all of it on the device."""
    reported = buffers.by_device("model", where) if buffers is not None else {}
    if sum(reported.values()) > 0:
        return reported
    if model.size_bytes <= 0:
        raise FitError(f"llama.cpp reported no weights for {model.spec.path}")
    return {where.devices[0]: model.size_bytes}


def output_bytes(model: Model, spec: ContextSpec, rows: int, hidden_rows: int) -> int:
    """llama.cpp's output buffer once decodes have asked for ``rows`` output rows and
    ``hidden_rows`` NextN hidden rows (``llama_context::output_reserve``)."""
    return _FLOAT * (model.n_vocab * max(rows, spec.n_seq_max) + model.n_embd * hidden_rows)


def measure_context(model: Model, spec: ContextSpec, where: DeviceMap, rows: int,
                    hidden_rows: int = 0) -> ContextMemory:
    """Create ``spec`` over the no_alloc ``model`` and read what llama.cpp sized for it."""
    try:
        with capture_llama_log() as lines:
            Context(model, spec).close()
    except LlamaError as exc:
        raise FitError(f"cannot measure a context of {spec.n_ctx} tokens: {exc}") from exc
    found = parse_buffers(lines)
    try:
        kv = found.kv_by_device(where)
    except ValueError as exc:
        raise FitError(f"cannot place the KV cache of {spec.n_ctx} tokens: {exc}") from exc
    runtime = output_bytes(model, spec, rows, hidden_rows)
    return ContextMemory(
        kv=kv,
        recurrent=found.by_device("recurrent", where),
        recurrent_layers=found.recurrent_layers_by_device(where),
        compute=found.by_device("compute", where),
        output_created=found.total("output"),
        output_runtime=runtime,
    )


def measure_prefix_checkpoint(model: Model, spec: ContextSpec) -> int:
    """Bytes of the largest prefix checkpoint of one sequence (0: none is needed), measured
    on a small real context the way the engine measures its reservation
    (:func:`worker.engine.prefix_cache.checkpoint_bytes`). The state's header depends on
    the sequences a context holds, so the probe keeps the engine's ``n_seq_max``."""
    small = spec.with_(n_ctx=_PROBE_CTX * spec.n_seq_max, n_batch=_PROBE_CTX)
    try:
        with Context(model, small) as ctx:
            return checkpoint_bytes(model, ctx)
    except LlamaError as exc:
        raise FitError(f"cannot measure a prefix checkpoint: {exc}") from exc


def measure_state(model: Model, spec: ContextSpec) -> StateSizes:
    """Exact recurrent-state sizes from a small real context over the real ``model``.

    An empty sequence has no recurrent rows, so one token is decoded first.
    """
    small = spec.with_(n_ctx=_PROBE_CTX, n_batch=_PROBE_CTX, n_seq_max=1, n_rs_seq=0)
    try:
        with Context(model, small) as ctx:
            with Batch(1) as batch:
                ctx.decode(batch.set([0], 0))
            host = ctx.state_size(_PARTIAL)
            header = ctx.state_size(_PARTIAL | _ON_DEVICE)
    except LlamaError as exc:
        raise FitError(f"cannot measure the recurrent state: {exc}") from exc
    if host <= header:
        raise FitError(
            f"measured recurrent state is empty (PARTIAL_ONLY {host} B, header {header} B): "
            "cannot size snapshots or checkpoints"
        )
    return StateSizes(group=host - header, host_checkpoint=host)

