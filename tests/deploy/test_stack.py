"""Bring the compose stack up for real and serve one request through the CLI and one through
the gateway. Needs a Docker engine with the compose plugin (the first build compiles
llama-cpp-python: tens of minutes); skipped, saying why, everywhere else."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from .files import COMPOSE, ROOT, env_example
from .redis_nodes import free_port

BUILD_AND_START_SECONDS = 3600


def _docker() -> str:
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("no docker CLI on PATH: the compose stack cannot be brought up here")
    info = subprocess.run([docker, "info"], capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        reason = (info.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"no Docker engine (`docker info` failed: {reason})")
    plugin = subprocess.run([docker, "compose", "version"], capture_output=True, text=True,
                            timeout=60)
    if plugin.returncode != 0:
        pytest.skip("the docker compose plugin is not installed")
    return docker


@pytest.fixture
def compose_stack(tmp_path: Path) -> Iterator[tuple[list[str], int]]:
    docker = _docker()
    port = free_port()
    env = {**env_example(), "SPECFLEET_WORKER_PASSWORD": uuid.uuid4().hex,
           "SPECFLEET_CLIENT_PASSWORD": uuid.uuid4().hex,
           "SPECFLEET_ADMIN_PASSWORD": uuid.uuid4().hex, "SPECFLEET_GATEWAY_PORT": str(port),
           "SPECFLEET_MODELS_DIR": str(tmp_path / "models"),
           "SPECFLEET_TAG": f"test-{uuid.uuid4().hex[:8]}"}
    env_file = tmp_path / ".env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    compose = [docker, "compose", "-f", str(COMPOSE), "--project-directory", str(ROOT),
               "-p", f"specfleet-test-{uuid.uuid4().hex[:8]}", "--env-file", str(env_file)]
    try:
        subprocess.run([*compose, "up", "-d", "--build", "--wait", "--wait-timeout",
                        str(BUILD_AND_START_SECONDS)], check=True,
                       timeout=BUILD_AND_START_SECONDS + 60)
        yield compose, port
    finally:
        subprocess.run([*compose, "down", "-v", "--remove-orphans", "--rmi", "local"],
                       timeout=600)


def test_the_stack_serves_a_request_from_the_cli_and_the_gateway(
        compose_stack: tuple[list[str], int]) -> None:
    compose, port = compose_stack
    done = subprocess.run([*compose, "run", "--rm", "client", "specfleet", "submit", "--model",
                           "gemma-270m", "--prompt", "The capital of France is",
                           "--max-tokens", "8", "--json"],
                          capture_output=True, text=True, timeout=600, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["status"] == "finished" and len(result["tokens"]) == 8

    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", method="POST",
        headers={"Content-Type": "application/json"},
        data=json.dumps({"model": "gemma-270m", "prompt": "Hello", "max_tokens": 8}).encode())
    with urllib.request.urlopen(request, timeout=300) as reply:
        body = json.loads(reply.read())
    assert body["usage"]["completion_tokens"] == 8
