"""llama.cpp's own reports of the buffers it allocates, read from its log lines.

The Python binding exposes no memory breakdown (``llama_get_memory_breakdown`` is C++ only), but
llama.cpp logs every buffer it creates, by kind and buffer type, with 0.01 MiB resolution
(0.001 MiB for checkpoint buffers). Under ``no_alloc`` the model and KV *buffer* lines print
0.00 MiB while the ``llama_kv_cache: size =`` line, the recurrent buffer and the compute buffer
are real figures, so the fitter reads ``kv_size`` there and ``kv_buffer`` from a real load.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

MIB = 1024 * 1024

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


@dataclass
class Buffers:
    """Bytes per kind and buffer type, as llama.cpp logged them (summed over repeats)."""

    sizes: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(dict))

    def total(self, kind: str, device: str | None = None) -> int:
        """Bytes of ``kind``; with ``device``, only buffers that live on that device."""
        return sum(n for buft, n in self.sizes.get(kind, {}).items()
                   if device is None or on_device(buft, device))

    def grand_total(self, kinds: Iterable[str], device: str | None = None) -> int:
        return sum(self.total(kind, device) for kind in kinds)


def on_device(buffer_type: str, device: str) -> bool:
    """Whether a llama.cpp buffer type (``CPU``, ``CPU_REPACK``, ``CUDA0``, ``CUDA_Host``)
    occupies ``device`` (``cpu`` or ``cuda:N``). On a CPU worker everything is host memory."""
    if device == "cpu":
        return True
    return buffer_type == "CUDA" + device.removeprefix("cuda:")


def parse_buffers(lines: Iterable[str]) -> Buffers:
    """Every buffer size llama.cpp reported in ``lines`` (from ``capture_llama_log``)."""
    found = Buffers()
    for line in lines:
        if "MiB" not in line:
            continue
        for kind, pattern in _PATTERNS.items():
            m = pattern.search(line)
            if m:
                per_type = found.sizes[kind]
                per_type[m.group(1)] = per_type.get(m.group(1), 0) + round(float(m.group(2)) * MIB)
                break
    return found
