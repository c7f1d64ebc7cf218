"""Does the gateway answer every client mistake with a 4xx that names the field, and stay up?

Replays the security review's probes (and every one added since) against a gateway: lone
surrogates in a body, stream ids rq cannot hold, JSON sent as ``text/plain`` or without a
Content-Type, deep nesting, a foreign Host or Origin, the constraints that crashed or stalled
the gateway (``tests/probes.py``), and each field accepted without effect
(``coordinator.openai_api.fields.NO_EFFECT``) sent with the wrong type, with null and with a
right value. The probe list grows by itself with that set; ``tests/gateway/
test_client_mistakes.py`` runs the same list (:func:`probes`) and the same checks
(:func:`wrong`), so there is one list.

    ./.venv/bin/python bench/fuzz.py                    # its own Redis (if none), worker, gateway
    ./.venv/bin/python bench/fuzz.py --url http://127.0.0.1:8000 --model gemma [--api-key KEY]

Against ``--url`` the model must have a live worker (the probes that should pass generate one
token). The Host and Origin probes expect a gateway with the default ``--allowed-hosts`` of a
loopback bind and no ``--cors-origins``. Prints one row per probe: the status expected and
received, seconds, the longest ``/health`` answer while the probe was in flight (how long it
held the event loop) and whether ``/health`` still answered afterwards; exits 1 when a probe was
answered otherwise or the gateway stopped answering.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from probes import (  # noqa: E402
    chained_lark,
    chat_with_grammar,
    chat_with_schema,
    empty_language_schema,
    pattern_properties_schema,
    ref_chain_schema,
)

from coordinator.client import Coordinator  # noqa: E402
from coordinator.openai_api.fields import MAX_METADATA_KEY, MAX_METADATA_PAIRS, NO_EFFECT  # noqa: E402
from coordinator.processes import stop_processes  # noqa: E402
from coordinator.redis_local import free_port, local_redis  # noqa: E402
from shared.settings import Settings  # noqa: E402

BIN = Path(sys.executable).parent
JSON = (("Content-Type", "application/json"),)
#: A right value of each field accepted without effect: a field added to ``NO_EFFECT`` without
#: one here fails :func:`probes` (KeyError), so it is probed from its first day.
RIGHT: dict[str, Any] = {"user": "user-1", "metadata": {"run": "nightly"}, "store": False,
                         "prompt_cache_retention": "24h", "prompt_cache_options": {},
                         "service_tier": "auto", "prompt_cache_key": "key-1",
                         "safety_identifier": "hash-1", "parallel_tool_calls": True}
#: The keys of OpenAI's error object, each a string or null (``message`` and ``type``
#: strings).
ERROR_KEYS = ("message", "type", "param", "code")


@dataclass(frozen=True)
class Probe:
    """One request and how the gateway must answer it: ``status``, and for a 4xx the
    ``param`` the error names (None: it names none)."""

    name: str
    method: str
    path: str
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = JSON
    status: int = 400
    param: str | None = None


def _json(value: object) -> bytes:
    """A body as clients send it (``ensure_ascii``: a lone surrogate travels as ``\\ud800``)."""
    return json.dumps(value).encode()


def bodies(model: str) -> dict[str, dict[str, Any]]:
    """A body each generating endpoint answers with one token: the probes change one thing."""
    return {"/v1/chat/completions": {"model": model, "max_tokens": 1,
                                     "messages": [{"role": "user", "content": "hi"}]},
            "/v1/completions": {"model": model, "prompt": "hi", "max_tokens": 1},
            "/v1/responses": {"model": model, "input": "hi", "max_output_tokens": 1}}


def _endpoint_probes(path: str, body: dict[str, Any]) -> Iterator[Probe]:
    """What every generating endpoint must refuse by name, and the fields it accepts."""
    yield Probe(f"{path} lone surrogate in model", "POST", path,
                _json({**body, "model": "\ud800"}), param="model")
    yield Probe(f"{path} JSON sent as text/plain", "POST", path, _json(body),
                (("Content-Type", "text/plain"),), 415, "Content-Type")
    for name in sorted(NO_EFFECT):
        yield Probe(f"{path} {name} of the wrong type", "POST", path,
                    _json({**body, name: [1]}), param=name)
    yield Probe(f"{path} every no-effect field null", "POST", path,
                _json({**body, **dict.fromkeys(NO_EFFECT)}), status=200)
    yield Probe(f"{path} every no-effect field right", "POST", path,
                _json({**body, **{name: RIGHT[name] for name in NO_EFFECT}}), status=200)


def probes(model: str) -> list[Probe]:
    """Every probe, for a gateway serving ``model``."""
    chat = bodies(model)["/v1/chat/completions"]
    found = [p for path, body in bodies(model).items() for p in _endpoint_probes(path, body)]
    deep = b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    return found + [
        Probe("chat lone surrogate in a message", "POST", "/v1/chat/completions",
              _json({**chat, "messages": [{"role": "user", "content": "a\udc00"}]}),
              param="messages.0.content"),
        Probe("chat lone surrogate in a metadata key", "POST", "/v1/chat/completions",
              _json({**chat, "metadata": {"\udc00": "v"}}), param="metadata.\\udc00"),
        Probe("chat metadata over 16 pairs", "POST", "/v1/chat/completions",
              _json({**chat, "metadata": {str(i): "v" for i in range(MAX_METADATA_PAIRS + 1)}}),
              param="metadata"),
        Probe("chat metadata key over 64", "POST", "/v1/chat/completions",
              _json({**chat, "metadata": {"k" * (MAX_METADATA_KEY + 1): "v"}}),
              param="metadata"),
        Probe("chat service_tier unknown", "POST", "/v1/chat/completions",
              _json({**chat, "service_tier": "fast"}), param="service_tier"),
        Probe("chat body without Content-Type", "POST", "/v1/chat/completions", _json(chat), (),
              415, "Content-Type"),
        Probe("chat body as a form (curl -d)", "POST", "/v1/chat/completions", _json(chat),
              (("Content-Type", "application/x-www-form-urlencoded"),), 415, "Content-Type"),
        Probe("batch create as text/plain", "POST", "/v1/batches",
              _json({"input_file_id": "file-x", "endpoint": "/v1/completions"}),
              (("Content-Type", "text/plain"),), 415, "Content-Type"),
        Probe("file upload as JSON", "POST", "/v1/files", b"{}", status=415,
              param="Content-Type"),
        Probe("body nested 100k deep", "POST", "/v1/completions", deep),
        Probe("stream id with *", "GET", "/v1/specfleet/streams/chatcmpl-a*b", status=404,
              param="completion_id"),
        Probe("stream id not UTF-8", "GET", "/v1/specfleet/streams/cmpl-%ED%A0%80",
              status=404, param="completion_id"),
        Probe("file id with *", "GET", "/v1/files/a*b", status=404, param="file_id"),
        Probe("batch id NUL", "GET", "/v1/batches/%00", status=404, param="batch_id"),
        Probe("cancel unknown batch", "POST", "/v1/batches/batch_x/cancel", headers=(),
              status=404, param="batch_id"),
        Probe("file list limit not a number", "GET", "/v1/files?limit=abc", param="limit"),
        Probe("foreign Host", "GET", "/v1/models", headers=(("Host", "rebound.example"),),
              status=421, param="Host"),
        Probe("foreign Origin", "POST", "/v1/chat/completions", _json(chat),
              (*JSON, ("Origin", "https://evil.example")), 403, "Origin"),
        *_constraint_probes(model),
    ]


def _constraint_probes(model: str) -> list[Probe]:
    """The constraints that crashed or stalled a process (``tests/probes.py``)."""
    chat = "/v1/chat/completions"
    return [
        Probe("chat $ref chain 1,200 deep (segfaulted)", "POST", chat,
              _json(chat_with_schema(model, ref_chain_schema())), param="response_format"),
        Probe("chat Lark of 3,000 chained rules (segfaulted)", "POST", chat,
              _json(chat_with_grammar(model, chained_lark())), param="specfleet.grammar"),
        Probe("chat 450 patternProperties (32 s on the loop)", "POST", chat,
              _json(chat_with_schema(model, pattern_properties_schema())),
              param="response_format"),
        Probe("chat schema no document satisfies", "POST", chat,
              _json(chat_with_schema(model, empty_language_schema()))),
    ]


def send(http: httpx.Client, probe: Probe) -> httpx.Response:
    """``probe`` sent as it is written (its path already percent-encoded)."""
    return http.request(probe.method, httpx.URL(str(http.base_url).rstrip("/") + probe.path),
                        content=probe.body or None, headers=dict(probe.headers))


def error_shape(response: httpx.Response) -> str | None:
    """What is wrong with a 4xx's body as OpenAI's error object, or None."""
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"not an OpenAI error: {response.text[:200]!r}"
    if not isinstance(error, dict) or set(error) != set(ERROR_KEYS):
        return f"error keys {sorted(error) if isinstance(error, dict) else error!r}"
    if not (isinstance(error["message"], str) and isinstance(error["type"], str)
            and all(error[k] is None or isinstance(error[k], str) for k in ("param", "code"))):
        return f"error field types: {error!r}"
    return None


def wrong(probe: Probe, response: httpx.Response) -> str | None:
    """How ``response`` differs from what ``probe`` expects, or None."""
    if response.status_code != probe.status:
        return f"status {response.status_code}, expected {probe.status}: {response.text[:300]}"
    if response.status_code < 400:
        return None
    shape = error_shape(response)
    if shape is not None:
        return shape
    param = response.json()["error"]["param"]
    return None if param == probe.param else f"param {param!r}, expected {probe.param!r}"


def _up(http: httpx.Client) -> bool:
    try:
        return http.get("/health", timeout=10).status_code == 200
    except httpx.TransportError:
        return False


class _HealthWatch(threading.Thread):
    """``/health`` asked back to back while a probe is in flight: the longest answer is how
    long the probe held the gateway's event loop (0 when it answered at once)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.longest = 0.0
        self.done = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as http:
            while True:  # at least once, however soon the probe is answered
                t0 = time.perf_counter()
                _up(http)
                self.longest = max(self.longest, time.perf_counter() - t0)
                if self.done.wait(0.005):
                    return


def run(url: str, model: str, api_key: str | None) -> bool:
    """Every probe against the gateway at ``url``, one row each (with the longest ``/health``
    answer while it was in flight); True when all were answered as expected and the gateway
    answered throughout."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    ok = True
    print(f"{'probe':<60} {'want':>4} {'got':>4} {'seconds':>8} {'health ms':>9}  up  problem")
    with httpx.Client(base_url=url, headers=headers, timeout=120) as http:
        for probe in probes(model):
            watch = _HealthWatch(url)
            watch.start()
            t0 = time.perf_counter()
            try:
                response = send(http, probe)
                status, problem = str(response.status_code), wrong(probe, response)
            except httpx.TransportError as exc:
                status, problem = "-", f"{type(exc).__name__}: {exc}"
            seconds = time.perf_counter() - t0
            watch.done.set()
            watch.join()
            up = _up(http)
            ok = ok and problem is None and up
            print(f"{probe.name[:60]:<60} {probe.status:>4} {status:>4} {seconds:>8.3f} "
                  f"{watch.longest * 1000:>9.1f}  {'yes' if up else 'NO':<3} {problem or ''}",
                  flush=True)
    return ok


@contextmanager
def own_gateway(model: str) -> Iterator[str]:
    """A gateway and one worker on the tiny chat model, on a Redis of their own prefix (one
    is started when none answers), whose keys are deleted afterwards; yields the gateway's
    URL."""
    from worker.testmodels.tiny import write_dense_llama  # noqa: PLC0415  (worker extra)

    with tempfile.TemporaryDirectory(prefix="specfleet-fuzz-") as tmp, local_redis() as redis:
        gguf = write_dense_llama(Path(tmp) / "tiny-chat.gguf", chat=True)
        settings = Settings(redis_url=redis, prefix=f"fuzz-{uuid.uuid4().hex[:8]}")
        env = {**os.environ, "REDIS_URL": redis, "SPECFLEET_PREFIX": settings.prefix,
               "SPECFLEET_LOG_LEVEL": "warning", "CUDA_VISIBLE_DEVICES": ""}
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL) for cmd in (
            [str(BIN / "specfleet"), "serve", "--port", str(port)],
            [str(BIN / "specfleet"), "worker", "--model", str(gguf), "--model-name", model,
             "--ctx", "512", "--threads", "1"])]
        coordinator = Coordinator(settings)
        try:
            registry = coordinator.registry
            deadline = time.monotonic() + 300
            with httpx.Client(base_url=url) as http:
                while not (registry.live_workers(model) and _up(http)):
                    if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                        raise SystemExit("fuzz: the worker or the gateway did not start")
                    time.sleep(0.1)
            yield url
        finally:
            stop_processes(procs, timeout=30)
            for key in coordinator.connection.scan_iter(f"*{settings.prefix}*"):
                coordinator.connection.delete(key)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running gateway (default: start one)")
    parser.add_argument("--model", default="tiny", help="a model the gateway serves")
    parser.add_argument("--api-key", default=os.environ.get("SPECFLEET_API_KEY"),
                        help="its API key, if it has keys (default $SPECFLEET_API_KEY)")
    args = parser.parse_args()
    if args.url:
        ok = run(args.url, args.model, args.api_key)
    else:
        with own_gateway(args.model) as url:
            ok = run(url, args.model, args.api_key)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
