"""Choosing the token a target output row commits: greedy argmax or temperature sampling.

The verify step asks a picker for every row it checks, so greedy speculation and plain
sampling share one loop. Sampling runs in llama.cpp's own sampler chain: a softmax over a
262k vocabulary in numpy would cost more than the decode it follows.
"""

from __future__ import annotations

from typing import Protocol

import llama_cpp

from worker.llm import Context


class TokenPicker(Protocol):
    """Picks the token for output row ``row`` of the context's last decode."""

    def __call__(self, ctx: Context, row: int) -> int: ...

    def close(self) -> None: ...


class GreedyPicker:
    """Argmax straight on the logits view (no copy of the vocabulary-sized row)."""

    def __call__(self, ctx: Context, row: int) -> int:
        return ctx.argmax(row)

    def close(self) -> None:
        """Nothing to free; present so every picker can be closed the same way."""


class TemperatureSampler:
    """Temperature then a seeded draw, so a (prompt, seed) pair always gives the same text."""

    def __init__(self, temperature: float, seed: int) -> None:
        params = llama_cpp.llama_sampler_chain_default_params()
        params.no_perf = True
        self._chain = llama_cpp.llama_sampler_chain_init(params)
        for stage in (llama_cpp.llama_sampler_init_temp(temperature),
                      llama_cpp.llama_sampler_init_dist(seed)):
            llama_cpp.llama_sampler_chain_add(self._chain, stage)

    def __call__(self, ctx: Context, row: int) -> int:
        return int(llama_cpp.llama_sampler_sample(self._chain, ctx.ptr, row))

    def close(self) -> None:
        if self._chain is not None:
            llama_cpp.llama_sampler_free(self._chain)
            self._chain = None


def make_picker(temperature: float, seed: int) -> TokenPicker:
    """Greedy at temperature 0 (the only mode speculation accepts), sampling above."""
    if temperature > 0:
        return TemperatureSampler(temperature, seed)
    return GreedyPicker()
