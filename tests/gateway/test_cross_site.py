"""A web page cannot drive a gateway it was not allowed to (docs/http.md, "Cross-site
requests"): JSON sent as ``text/plain`` (no CORS preflight) is a 415 and queues nothing, a
foreign Host is a 421 (DNS rebinding), a foreign Origin a 403, while the gateway's own origin,
an allowed CORS origin and the real ``openai`` client pass; ``/openapi.json`` is behind the
API key."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx

from coordinator.client import Coordinator
from coordinator.gateway.cross_site import LOOPBACK_NAMES, allowed_hosts
from shared.protocol import WorkerInfo
from shared.settings import Settings

from .conftest import Deployment
from .gateway import Gateway

from service.workers import MODEL_NAME  # isort: skip

KEY = "sk-cross-site-0123"
BODY = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}


def _pretend_worker(coordinator: Coordinator) -> None:
    """A live registration and no process: admission passes and a job stays queued."""
    now = time.time()
    coordinator.registry.register(WorkerInfo(
        name="idle", model_name=MODEL_NAME, model_path="/m.gguf", device="cpu", n_ctx=512,
        version="test", pid=1, host="h", started_at=now, heartbeat_at=now))


def _queued(coordinator: Coordinator) -> int:
    return sum(coordinator.queue_depths(MODEL_NAME).values())


def _refusal(response: httpx.Response, status: int, param: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    return str(error["message"])


def test_json_sent_as_anything_but_application_json_is_refused_and_queues_nothing(
        settings: Settings, tmp_path: Path) -> None:
    coordinator = Coordinator(settings)
    gateway = Gateway(settings, tmp_path).start()
    try:
        url = gateway.url + "/v1/completions"
        body = json.dumps({**BODY, "stream": True}).encode()
        for media_type in ("text/plain", "text/plain;charset=UTF-8",
                           "application/x-www-form-urlencoded", None):  # None: curl -H 'C-T:'
            _pretend_worker(coordinator)
            headers = {"Content-Type": media_type} if media_type else {}
            refused = httpx.post(url, content=body, headers=headers)
            assert "application/json" in _refusal(refused, 415, "Content-Type")
        assert _queued(coordinator) == 0
        # the same body as JSON (parameters allowed) is queued behind the worker that is not
        _pretend_worker(coordinator)
        with httpx.stream("POST", url, json={**BODY, "stream": True},
                          headers={"Content-Type": "application/json; charset=utf-8"}) as taken:
            assert taken.status_code == 200
            assert _queued(coordinator) == 1
        upload = httpx.post(gateway.url + "/v1/files", json={"file": "x"})
        _refusal(upload, 415, "Content-Type")  # uploads are multipart
    finally:
        gateway.stop()


def test_a_foreign_host_is_refused_and_health_answers_any(deployment: Deployment) -> None:
    url = deployment.gateway.url
    port = deployment.gateway.port
    for host in (f"rebound.example:{port}", "rebound.example", f"127.0.0.2:{port}"):
        message = _refusal(httpx.get(url + "/v1/models", headers={"Host": host}), 421, "Host")
        assert "--allowed-hosts" in message and "SPECFLEET_ALLOWED_HOSTS" in message
        health = httpx.get(url + "/health", headers={"Host": host, "Origin": "null",
                                                     "Sec-Fetch-Site": "cross-site"})
        assert health.status_code == 200 and health.json()["status"] == "ok"
    refused = httpx.post(url + "/v1/completions", json=BODY, headers={"Host": "rebound.example"})
    _refusal(refused, 421, "Host")
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST"):
        assert httpx.get(url + "/v1/models", headers={"Host": host}).status_code == 200


def test_allowed_hosts_follow_the_bind_unless_set() -> None:
    assert allowed_hosts("", "127.0.0.1") == LOOPBACK_NAMES
    assert allowed_hosts("", "::1") == LOOPBACK_NAMES
    assert allowed_hosts("", "localhost") == LOOPBACK_NAMES
    assert allowed_hosts("", "127.0.0.2") == LOOPBACK_NAMES | {"127.0.0.2"}
    assert allowed_hosts("", "0.0.0.0") is None and allowed_hosts("", "::") is None
    assert allowed_hosts("", "10.1.2.3") == {"10.1.2.3"}
    assert allowed_hosts("", "fe80::0:1") == {"[fe80::1]"}
    assert allowed_hosts("api.example, API2.example:8443,::1", "0.0.0.0") == {
        "api.example", "api2.example", "[::1]"}
    assert allowed_hosts("api.example,*", "127.0.0.1") is None


def test_allowed_hosts_replace_the_default(settings: Settings, tmp_path: Path) -> None:
    gateway = Gateway(settings, tmp_path, args=("--allowed-hosts", "api.example")).start()
    try:
        url = gateway.url + "/v1/models"
        assert httpx.get(url, headers={"Host": "api.example"}).status_code == 200
        _refusal(httpx.get(url), 421, "Host")  # 127.0.0.1 is not in the list given
    finally:
        gateway.stop()
    anywhere = Gateway(settings, tmp_path, env={"SPECFLEET_ALLOWED_HOSTS": "*"}).start()
    try:
        assert httpx.get(anywhere.url + "/v1/models",
                         headers={"Host": "rebound.example"}).status_code == 200
    finally:
        anywhere.stop()


def test_a_foreign_origin_is_refused_and_the_gateways_own_passes(
        deployment: Deployment) -> None:
    url = deployment.gateway.url
    other_port = f"http://127.0.0.1:{deployment.gateway.port + 1}"
    for origin in ("https://evil.example", "null", other_port, "http://localhost"):
        refused = httpx.post(url + "/v1/completions", json=BODY, headers={"Origin": origin})
        assert "--cors-origins" in _refusal(refused, 403, "Origin")
        _refusal(httpx.get(url + "/v1/models", headers={"Origin": origin}), 403, "Origin")
    _refusal(httpx.post(url + "/v1/batches/batch_x/cancel",
                        headers={"Origin": "https://evil.example"}), 403, "Origin")
    # no Origin, but a browser says another site made the request (an <img>, a link)
    _refusal(httpx.get(url + "/v1/models", headers={"Sec-Fetch-Site": "cross-site"}), 403,
             "Origin")
    # a page the gateway serves itself (a future console) is its own origin
    own = {"Origin": url, "Sec-Fetch-Site": "same-origin"}
    reply = httpx.post(url + "/v1/completions", json=BODY, headers=own, timeout=60)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 1
    assert httpx.get(url + "/v1/models", headers={"Origin": url.upper()}).status_code == 200
    # a preflight runs nothing: without CORS origins it stays a 405
    preflight = httpx.options(url + "/v1/completions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 405


def test_the_openai_client_is_unaffected(deployment: Deployment) -> None:
    client = deployment.client()
    chat = client.chat.completions.create(model=MODEL_NAME, max_tokens=1,
                                          messages=[{"role": "user", "content": "hi"}])
    assert chat.usage is not None and chat.usage.completion_tokens == 1
    reply = client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=1)
    assert reply.usage is not None and reply.usage.output_tokens == 1
    uploaded = client.files.create(file=("a.jsonl", b'{"x": 1}\n'), purpose="batch")
    assert client.files.delete(uploaded.id).deleted is True


def test_an_allowed_cors_origin_passes_and_openapi_needs_the_key(settings: Settings,
                                                                 tmp_path: Path) -> None:
    gateway = Gateway(settings, tmp_path, env={"SPECFLEET_API_KEYS": KEY},
                      args=("--cors-origins", "https://app.example")).start()
    try:
        url = gateway.url
        auth = {"Authorization": f"Bearer {KEY}"}
        app = {**auth, "Origin": "https://app.example"}
        allowed = httpx.get(url + "/v1/models", headers=app)
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == "https://app.example"
        # a refusal an allowed page receives carries CORS headers: the page can read why
        plain = httpx.post(url + "/v1/completions", content=b"{}",
                           headers={**app, "Content-Type": "text/plain"})
        _refusal(plain, 415, "Content-Type")
        assert plain.headers["access-control-allow-origin"] == "https://app.example"
        evil = {**auth, "Origin": "https://evil.example"}
        _refusal(httpx.get(url + "/v1/models", headers=evil), 403, "Origin")
        assert httpx.get(url + "/openapi.json").status_code == 401
        schema = httpx.get(url + "/openapi.json", headers=auth)
        assert schema.status_code == 200 and "/v1/chat/completions" in schema.json()["paths"]
        assert "/openapi.json" not in schema.json()["paths"]
    finally:
        gateway.stop()
