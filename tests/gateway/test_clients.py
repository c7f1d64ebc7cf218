"""Streams that every OpenAI client reads: the real ``openai`` (sync and ``AsyncOpenAI``),
``langchain-openai`` and ``litellm`` streams, queued for 20+ s behind a busy slot while the
gateway sends keep-alives every second, all complete with the same text.

The keep-alive used to be a comment followed by a blank line; the SDK's SSE decoder keeps the
last ``id:`` and dispatched the blank line as an empty event, whose ``json.loads("")`` killed
the queued streams of every one of these clients.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai

from coordinator.client import Coordinator
from shared.protocol import JobStatus
from shared.settings import Settings

from .gateway import Gateway

from service.workers import MODEL_NAME, Fleet  # isort: skip

#: Seconds the blocking job holds the worker's only slot (its steps are slowed down).
BLOCK_SECONDS = 21
STEP_DELAY = 0.1
MESSAGES = [{"role": "user", "content": "hi"}]


def _openai_sync(base: str) -> str:
    client = openai.OpenAI(base_url=base, api_key="x", max_retries=0, timeout=120)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES,  # type: ignore[arg-type]
                                            max_tokens=4, temperature=0, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def _openai_async(base: str) -> str:
    async def run() -> str:
        client = openai.AsyncOpenAI(base_url=base, api_key="x", max_retries=0, timeout=120)
        stream = await client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=4, temperature=0,  # type: ignore[arg-type]
            stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        await client.close()
        return text
    return asyncio.run(run())


def _langchain(base: str) -> str:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=MODEL_NAME, base_url=base, api_key="x",  # type: ignore[arg-type]
                      max_tokens=4, temperature=0, max_retries=0, timeout=120)  # type: ignore[call-arg]
    return "".join(str(chunk.content) for chunk in chat.stream("hi"))


def _litellm(base: str) -> str:
    import litellm

    stream = litellm.completion(model=f"openai/{MODEL_NAME}", api_base=base, api_key="x",
                                messages=MESSAGES, max_tokens=4, temperature=0, stream=True,
                                timeout=120, num_retries=0)
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


CLIENTS: dict[str, Callable[[str], str]] = {
    "openai": _openai_sync, "AsyncOpenAI": _openai_async, "langchain-openai": _langchain,
    "litellm": _litellm}


def _keepalives(url: str, seen: list[int], stop: threading.Event) -> None:
    """Count the keep-alive lines of a raw stream queued with the clients'."""
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=120, json={
            "model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, "temperature": 0,
            "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith(": ping"):
                seen[0] += 1
            if stop.is_set() or line == "data: [DONE]":
                break


def test_every_client_reads_a_stream_queued_20s_behind_a_busy_slot(
        settings: Settings, chat_model: Path, tmp_path: Path) -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch at import
    fleet = Fleet(settings, chat_model, tmp_path)
    gateway = Gateway(settings, tmp_path, env={"SPECFLEET_SSE_KEEPALIVE_SECONDS": "1"})
    try:
        fleet.start("w1", step_delay=STEP_DELAY)
        gateway.start()
        base = gateway.url + "/v1"
        expected = _openai_sync(base)  # the text each queued client must receive
        assert expected
        blocker = Coordinator(settings).submit({
            "model": MODEL_NAME, "prompt_tokens": [5, 17, 33, 2],
            "max_tokens": int(BLOCK_SECONDS / STEP_DELAY),
            "speculative": {"method": "none"}})
        deadline = time.monotonic() + 30
        while Coordinator(settings).fleet()[0].current_jobs != [blocker.job_id]:
            assert time.monotonic() < deadline, "the blocking job never started"
            time.sleep(0.05)
        started = time.monotonic()
        pings, stop = [0], threading.Event()
        with ThreadPoolExecutor(len(CLIENTS) + 1) as pool:
            raw = pool.submit(_keepalives, gateway.url, pings, stop)
            futures = {name: pool.submit(run, base) for name, run in CLIENTS.items()}
            texts = {name: f.result(timeout=120) for name, f in futures.items()}
            stop.set()
            raw.result(timeout=120)
        waited = time.monotonic() - started
        assert blocker.result(timeout=10).status is JobStatus.FINISHED
        assert texts == {name: expected for name in CLIENTS}
        assert waited >= BLOCK_SECONDS - 2 and pings[0] >= BLOCK_SECONDS - 6
    finally:
        gateway.stop()
        fleet.stop_all()
