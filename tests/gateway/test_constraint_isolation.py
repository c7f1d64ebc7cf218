"""One request must never take the gateway down or hold it up: constraints that crashed
llguidance in-process, or compiled for tens of seconds on the event loop, are 400s naming the
limit they hit, while other streams flow and ``/health`` answers throughout."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import openai
import pytest

from .gateway import Gateway

from probes import (  # isort: skip
    chained_lark,
    chat_with_grammar,
    chat_with_schema,
    empty_language_schema,
    pattern_properties_schema,
    ref_chain_schema,
)
from service.workers import MODEL_NAME, Fleet  # isort: skip


class _Stream(threading.Thread):
    """A streamed chat completion read in the background, each chunk's arrival timed."""

    def __init__(self, client: openai.OpenAI) -> None:
        super().__init__(daemon=True)
        self.client = client
        self.arrivals: list[float] = []
        self.finish_reason: str | None = None

    def run(self) -> None:
        stream = self.client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "go on"}], max_tokens=200,
            temperature=0, stream=True, extra_body={"specfleet": {"speculative": {
                "method": "none"}}})
        for chunk in stream:
            self.arrivals.append(time.monotonic())
            if chunk.choices and chunk.choices[0].finish_reason:
                self.finish_reason = chunk.choices[0].finish_reason


class _HealthProbe(threading.Thread):
    """``/health`` asked over and over until stopped; each answer's arrival timed."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.answers: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=60) as http:
            while not self.stop.is_set():
                if http.get(self.url + "/health").status_code == 200:
                    self.answers.append(time.monotonic())
                time.sleep(0.01)


def _post(gateway: Gateway, body: dict[str, Any]) -> tuple[httpx.Response, float, float]:
    start = time.monotonic()
    response = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=120)
    return response, start, time.monotonic()


def test_constraints_that_crashed_or_stalled_the_gateway_are_400s(fleet: Fleet,
                                                                   gateway: Gateway) -> None:
    fleet.start("w1", step_delay=0.02)
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    stream = _Stream(client)
    stream.start()
    while not stream.arrivals:
        assert stream.is_alive(), "the stream ended before its first chunk"
        time.sleep(0.01)
    health = _HealthProbe(gateway.url)
    health.start()
    probes = [  # (body, the field named, what the message says)
        (chat_with_schema(MODEL_NAME, ref_chain_schema()), "response_format",
         "nests too deeply to compile"),
        (chat_with_grammar(MODEL_NAME, chained_lark()), "specfleet.grammar",
         "nests too deeply to compile"),
        (chat_with_schema(MODEL_NAME, pattern_properties_schema()), "response_format",
         "SPECFLEET_CONSTRAINT_COMPILE_SECONDS"),
    ]
    flights = []
    for body, param, says in probes:
        response, start, end = _post(gateway, body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and says in error["message"], error
        flights.append((start, end))
        assert gateway.proc is not None and gateway.proc.poll() is None
    health.stop.set()
    health.join()
    stream.join(timeout=120)
    assert stream.finish_reason == "length"  # the stream ran to its end meanwhile
    # ... and it flowed, and /health answered, while the slow schema compiled (its budget,
    # half a second; in-process it took 32 s on the event loop)
    slow_start, slow_end = flights[-1]
    assert any(slow_start < t < slow_end for t in health.answers), "/health waited"
    assert any(slow_start < t < slow_end for t in stream.arrivals), "the stream waited"
    # A constraint no document satisfies compiles, and the worker refuses it: a client
    # mistake (400), not a server error for the SDK to retry.
    with pytest.raises(openai.BadRequestError, match="constraint"):
        client.chat.completions.create(**chat_with_schema(MODEL_NAME, empty_language_schema()))
    assert gateway.proc.poll() is None and fleet.alive("w1")
