"""No command prints the Redis password: each CLI command that talks to Redis, against a Redis
that refuses it.

Two real failures: a private ``redis-server`` with ``requirepass`` that rejects the URL's
credentials, and a port nothing listens on. Each command must fail with its one-line Redis
error naming the user and the host (what an operator needs to fix it) and must show the
password nowhere: not on stdout, not on stderr, not in a log line (debug level, JSON).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import SPECFLEET

from .private_redis import free_port, private_redis
from .workers import MODEL_NAME

USER = "specfleet-ops"
PASSWORD = "Hunter2-not-for-logs"

COMMANDS = {
    "submit": ("submit", "--model", MODEL_NAME, "--prompt-tokens", "1,2", "--max-tokens", "2"),
    "fleet": ("fleet", "--json"),
    "cancel": ("cancel", "0123456789abcdef"),
    "batch": ("batch", "{requests}", "--model", MODEL_NAME, "--out", "{out}"),
    "worker": ("worker", "--model", "{model}", "--model-name", MODEL_NAME, "--ctx", "64",
               "--threads", "1", "--name", "secrets-w"),
    "top": ("top", "--once", "--json"),
    "serve": ("serve", "--port", "0"),
}


@pytest.fixture(scope="module")
def refusing_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A Redis whose password is not ours: every command's AUTH fails."""
    with private_redis(tmp_path_factory.mktemp("locked"), "--requirepass", "another-one") as port:
        yield port


CASES = [(command, failure) for command in sorted(COMMANDS)
         for failure in ("wrong password", "unreachable")]


@pytest.fixture(scope="module")
def runs(refusing_redis: int, dense_model: Path, tmp_path_factory: pytest.TempPathFactory
         ) -> dict[tuple[str, str], tuple[int, subprocess.CompletedProcess[str]]]:
    """Every command against both failures, all at once: each spends most of its seconds in
    the Redis client's retry backoff, asleep, so together they take one command's time."""
    started = {}
    for command, failure in CASES:
        port = refusing_redis if failure == "wrong password" else free_port()
        work = tmp_path_factory.mktemp(f"{command}-{failure.replace(' ', '-')}")
        requests = work / "in.jsonl"
        requests.write_text(json.dumps({"custom_id": "a", "body": {"prompt_tokens": [1],
                                                                   "max_tokens": 1}}) + "\n")
        args = [a.format(requests=requests, out=work / "out.jsonl", model=dense_model)
                for a in COMMANDS[command]]
        env = {**os.environ, "REDIS_URL": f"redis://{USER}:{PASSWORD}@127.0.0.1:{port}/0",
               "SPECFLEET_PREFIX": "secrets", "SPECFLEET_LOG_LEVEL": "debug",
               "SPECFLEET_LOG_FORMAT": "json", "SPECFLEET_REDIS_OUTAGE_SECONDS": "1",
               "CUDA_VISIBLE_DEVICES": ""}
        started[command, failure] = port, subprocess.Popen(
            [SPECFLEET, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
    done = {}
    for case, (port, proc) in started.items():
        out, err = proc.communicate(timeout=120)
        done[case] = port, subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done


@pytest.mark.parametrize(("command", "failure"), CASES)
def test_a_redis_error_names_user_and_host_but_never_the_password(
        command: str, failure: str,
        runs: dict[tuple[str, str], tuple[int, subprocess.CompletedProcess[str]]]) -> None:
    port, done = runs[command, failure]
    assert done.returncode == 3, done.stderr
    assert PASSWORD not in done.stdout + done.stderr
    error = [line for line in done.stderr.splitlines() if line.startswith("specfleet: error:")]
    assert error, done.stderr
    assert f"redis://{USER}:***@127.0.0.1:{port}/0" in error[-1]
