"""llama.cpp's own reports of the buffers it allocates, read from its log lines, and the
device each one lives on.

The Python binding exposes no memory breakdown (``llama_get_memory_breakdown`` is C++ only), but
llama.cpp logs every buffer it creates, by kind and buffer type, with 0.01 MiB resolution
(0.001 MiB for checkpoint buffers). Under ``no_alloc`` the model and KV *buffer* lines print
0.00 MiB while the ``llama_kv_cache: size =`` line, the recurrent buffer and the compute buffer
are real figures, so the fitter reads ``kv_size`` there and ``kv_buffer`` from a real load.

Where a model spans devices, each cache's size is split by where llama.cpp put its layers:
its debug lines name the device of every KV and recurrent layer as the cache is built
(``llama_kv_cache: layer 3: dev = RPC1``), and every layer of one cache holds the same rows.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

MIB = 1024 * 1024
#: The host's memory beside GPUs: not a fitted device, reported as ``host_bytes``.
HOST = "host"

#: kind -> pattern with groups (buffer type, MiB).
_PATTERNS: dict[str, re.Pattern[str]] = {
    "model": re.compile(r"(\S+) model buffer size =\s*([\d.]+) MiB"),
    "kv_buffer": re.compile(r"(\S+) KV buffer size =\s*([\d.]+) MiB"),
    "kv_size": re.compile(r"(llama_kv_cache): size =\s*([\d.]+) MiB"),
    "recurrent": re.compile(r"(\S+) RS buffer size =\s*([\d.]+) MiB"),
    "output": re.compile(r"(\S+)\s+output buffer size =\s*([\d.]+) MiB"),
    "compute": re.compile(r"(\S+) compute buffer size =\s*([\d.]+) MiB"),
    "checkpoint": re.compile(r"allocated '([^']+)' buffer ([\d.]+) MiB"),
}
#: Debug lines: the device llama.cpp gave a layer of the model, a KV cache, a recurrent cache.
_MODEL_LAYER = re.compile(r"load_tensors: layer\s+(\d+) assigned to device ([^\s,]+)")
_KV_LAYER = re.compile(r"llama_kv_cache: layer\s+\d+: dev = (\S+)")
_KV_LAYERS = re.compile(r"llama_kv_cache: size =.*?,\s*(\d+) layers")
_RS_LAYER = re.compile(r"llama_memory_recurrent, layer\s+\d+: dev = (\S+)")


@dataclass(frozen=True)
class DeviceMap:
    """Which fitted device holds each of llama.cpp's buffer types and devices.

    ``devices`` are the fitted devices in the model's order; a buffer type or device name
    not listed is host memory (``CPU``, ``CPU_Mapped``, ``CPU_REPACK``, ``CUDA_Host``), which
    goes to ``host``: the ``cpu`` device of a CPU worker, :data:`HOST` beside GPUs.
    """

    devices: tuple[str, ...]
    host: str
    buffer_types: Mapping[str, str] = field(default_factory=dict)
    device_names: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def single(cls, device: str) -> DeviceMap:
        """One CPU device: every buffer is host memory, and the host is the device."""
        return cls((device,), device)

    def of_buffer(self, buffer_type: str) -> str:
        return self.buffer_types.get(buffer_type, self.host)

    def of_device(self, device_name: str) -> str:
        return self.device_names.get(device_name, self.host)

    @property
    def places(self) -> tuple[str, ...]:
        """Every place a byte can be: the devices, then the host where it is none of them."""
        return self.devices if self.host in self.devices else (*self.devices, HOST)


@dataclass
class Buffers:
    """Bytes per kind and buffer type, as llama.cpp logged them (summed over repeats), and
    the device of every layer it placed."""

    sizes: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(dict))
    #: One entry per KV cache built: its size and the device name of each of its layers.
    kv_caches: list[tuple[int, list[str]]] = field(default_factory=list)
    #: The device name of every recurrent layer.
    recurrent_layers: list[str] = field(default_factory=list)
    #: The device name of every model layer (the last one: the output layer).
    model_layers: list[str] = field(default_factory=list)

    def total(self, kind: str) -> int:
        """Bytes of ``kind`` over every buffer type."""
        return sum(self.sizes.get(kind, {}).values())

    def grand_total(self, kinds: Iterable[str]) -> int:
        return sum(self.total(kind) for kind in kinds)

    def by_device(self, kind: str, where: DeviceMap) -> dict[str, int]:
        """Bytes of ``kind`` per place (:attr:`DeviceMap.places`) its buffers live."""
        found: dict[str, int] = dict.fromkeys(where.places, 0)
        for buffer_type, n in self.sizes.get(kind, {}).items():
            found[where.of_buffer(buffer_type)] += n
        return found

    def kv_by_device(self, where: DeviceMap) -> dict[str, int]:
        """Every KV cache's size split over the places of its layers (exact: every layer of
        one cache holds the same rows). A cache whose layers were not all logged cannot be
        split: a ValueError, unless everything is one place anyway."""
        found: dict[str, int] = dict.fromkeys(where.places, 0)
        for size, layers in self.kv_caches:
            if len(where.places) == 1:
                found[where.places[0]] += size
                continue
            if not layers:
                raise ValueError("llama.cpp logged a KV cache without its layers' devices")
            for place, n in split(size, Counter(where.of_device(d) for d in layers)).items():
                found[place] += n
        return found

    def recurrent_layers_by_device(self, where: DeviceMap) -> Counter[str]:
        """Recurrent layers per place: one recurrent group's bytes split the same way."""
        return Counter(where.of_device(d) for d in self.recurrent_layers)

    def model_layers_by_device(self, where: DeviceMap) -> dict[str, int]:
        """Model layers per fitted device (the output layer counted as one)."""
        counts = Counter(where.of_device(d) for d in self.model_layers)
        return {device: counts.get(device, 0) for device in where.devices}


def split(total: int, counts: Mapping[str, int]) -> dict[str, int]:
    """``total`` bytes shared in proportion to ``counts`` (layers per place), whole bytes
    that add up to ``total``: the last place takes the rounding remainder."""
    n = sum(counts.values())
    if not n:
        return {}
    shares = {place: total * c // n for place, c in counts.items()}
    last = list(counts)[-1]
    shares[last] += total - sum(shares.values())
    return shares


def parse_buffers(lines: Iterable[str]) -> Buffers:
    """Every buffer size and layer placement llama.cpp reported in ``lines``
    (from ``capture_llama_log``)."""
    found = Buffers()
    kv_layers: list[str] = []
    for line in lines:
        if m := _KV_LAYER.search(line):
            kv_layers.append(m.group(1))
            continue
        if m := _RS_LAYER.search(line):
            found.recurrent_layers.append(m.group(1))
            continue
        if m := _MODEL_LAYER.search(line):
            found.model_layers.append(m.group(2))
            continue
        if "MiB" not in line:
            continue
        for kind, pattern in _PATTERNS.items():
            m = pattern.search(line)
            if m:
                size = round(float(m.group(2)) * MIB)
                per_type = found.sizes[kind]
                per_type[m.group(1)] = per_type.get(m.group(1), 0) + size
                if kind == "kv_size":
                    _close_cache(found, size, kv_layers, _KV_LAYERS.search(line))
                    kv_layers = []
                break
    return found


def _close_cache(found: Buffers, size: int, layers: list[str],
                 declared: re.Match[str] | None) -> None:
    """A cache's size line ends its layer lines: keep them only when they are all of it."""
    complete = declared is not None and int(declared.group(1)) == len(layers)
    found.kv_caches.append((size, layers if complete else []))
