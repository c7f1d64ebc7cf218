"""The gateway's edges: API keys (never logged), body limits, health and metrics."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from shared.settings import Settings

from .conftest import Deployment
from .gateway import Gateway

from service.workers import MODEL_NAME  # isort: skip

KEY = "sk-test-0123456789abcdef"


def test_api_keys_and_body_limits(settings: Settings, tmp_path: Path) -> None:
    gateway = Gateway(settings, tmp_path, env={"SPECFLEET_API_KEYS": f"other-key, {KEY}",
                                               "SPECFLEET_MAX_REQUEST_BYTES": "4096"}).start()
    try:
        url = gateway.url
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.get(url + "/v1/models", headers=headers)
            assert r.status_code == 401
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url + "/health").status_code == 200  # load balancers need no key
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        assert client.models.list().data == []  # authorised; no worker yet
        with pytest.raises(openai.APIStatusError) as big:
            client.completions.create(model=MODEL_NAME, prompt="x" * 5000, max_tokens=1)
        assert big.value.status_code == 413 and "exceeds 4096 bytes" in big.value.message
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        chunked = httpx.post(url + "/v1/completions", headers=headers,
                             content=iter([b"{" + b" " * 3000, b" " * 3000 + b"}"]))
        assert chunked.status_code == 413
        bad = httpx.post(url + "/v1/completions", headers=headers, content=b"[1, 2]")
        assert bad.status_code == 400 and "JSON object" in bad.json()["error"]["message"]
    finally:
        gateway.stop()
    assert KEY not in gateway.log() and "other-key" not in gateway.log()


def test_health_and_metrics_see_the_fleet(deployment: Deployment) -> None:
    health = httpx.get(deployment.gateway.url + "/health").json()
    assert health == {"status": "ok", "redis": True, "models": {MODEL_NAME: 1}}
    metrics = httpx.get(deployment.gateway.url + "/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    assert f'workers_live{{model="{MODEL_NAME}"}} 1.0' in metrics.text
    [model] = deployment.client().models.list().data
    assert model.id == MODEL_NAME and model.specfleet["chat_template"] is True
    [worker] = model.specfleet["workers"]
    assert (worker["name"], worker["n_ctx"], model.specfleet["max_context"]) == ("w1", 512, 512)
    assert worker["capacity"]["method"] == "suffix"  # what auto loads on a head-less model
