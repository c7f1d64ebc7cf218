"""The service under the documented Redis ACL (``docker/redis/users.acl.template``).

A private ``redis-server`` loads the template rendered for this test's prefix: the default
user is off, workers and clients connect as their restricted users. The core paths run through
it (submit + stream, cancel of a running job, batch, fleet and top, the HTTP gateway, recovery
after ``kill -9``), and
after each one Redis's own ``ACL LOG`` holds no denial and no worker log holds a ``NOPERM`` or a
traceback (rq's pub/sub thread dies with one when its channel is denied).
"""

from __future__ import annotations

import json
import secrets
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from string import Template

import httpx
import pytest
from helpers import specfleet
from redis import Redis, RedisError
from redis.exceptions import NoPermissionError

from coordinator.client import Coordinator
from shared.protocol import FinalEvent, JobStatus, ProgressEvent, TokenEvent
from shared.settings import Settings

from .private_redis import private_redis
from .workers import MODEL_NAME, Fleet

# tests/ is on sys.path (pytest's rootdir-relative import): the gateway tests' process helper.
from gateway.gateway import Gateway  # isort: skip

pytestmark = pytest.mark.timeout(120)  # each path, the module's start-up included

ACL_TEMPLATE = Path(__file__).parents[2] / "docker" / "redis" / "users.acl.template"
STEP_DELAY = 0.05  # slow enough that a cancel and a kill land mid-generation
# Long enough (~24 s) that a cancel from a freshly started CLI lands mid-run; within CTX.
LONG = {"model": MODEL_NAME, "prompt_tokens": [2, 7, 1, 8], "max_tokens": 480,
        "speculative": {"method": "none"}}


@dataclass
class AclDeployment:
    """One private Redis under the ACL, two workers, and the client's view of it."""

    fleet: Fleet
    client: Coordinator
    admin: Redis
    workers: list[str]

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Run ``specfleet`` as the client user."""
        env = self.fleet.env(0.0, {"REDIS_URL": self.client.settings.redis_url,
                                   "SPECFLEET_LOG_LEVEL": "warning"})
        return specfleet(*args, env=env)

    def assert_no_denials(self) -> None:
        """Redis denied nothing, and no worker logged a NOPERM or a traceback."""
        denied = sorted({(e["username"], e["reason"], e["object"], e["context"])
                         for e in self.admin.acl_log()})
        assert denied == []
        for name in self.workers:
            log = self.fleet.log(name)
            assert "NOPERM" not in log and "Traceback" not in log, log[-3000:]


def render_acl(prefix: str, worker_password: str, client_password: str) -> str:
    """The template as an operator renders it (``envsubst`` takes the same ``${VAR}``s)."""
    return Template(ACL_TEMPLATE.read_text()).substitute(
        SPECFLEET_PREFIX=prefix, SPECFLEET_WORKER_PASSWORD=worker_password,
        SPECFLEET_CLIENT_PASSWORD=client_password)


@pytest.fixture(scope="module")
def acl(tmp_path_factory: pytest.TempPathFactory, dense_model: Path) -> Iterator[AclDeployment]:
    workdir = tmp_path_factory.mktemp("acl")
    prefix = f"acl{uuid.uuid4().hex[:8]}"
    worker_pw, client_pw, admin_pw = (secrets.token_hex(12) for _ in range(3))
    aclfile = workdir / "users.acl"
    # The test's own admin (not part of the template) reads ACL LOG.
    aclfile.write_text(render_acl(prefix, worker_pw, client_pw)
                       + f"user acl-test-admin on >{admin_pw} ~* &* +@all\n")
    with private_redis(workdir, "--aclfile", str(aclfile)) as port:
        def settings(user: str, password: str) -> Settings:
            return Settings(redis_url=f"redis://{user}:{password}@127.0.0.1:{port}/0",
                            prefix=prefix, heartbeat_seconds=0.25, worker_ttl_seconds=1.5,
                            token_chunk=1, token_flush_seconds=0.0)

        admin = Redis(host="127.0.0.1", port=port, username="acl-test-admin",
                      password=admin_pw)
        fleet = Fleet(settings(f"{prefix}-worker", worker_pw), dense_model, workdir)
        deployment = AclDeployment(fleet, Coordinator(settings(f"{prefix}-client", client_pw)),
                                   admin, ["acl-w1", "acl-w2"])
        try:
            for name in deployment.workers:
                fleet.start(name, step_delay=STEP_DELAY, wait=False)
            for name in deployment.workers:
                fleet.wait_registered(name)
            yield deployment
        finally:
            fleet.stop_all()


def test_the_restricted_users_are_the_only_way_in(acl: AclDeployment) -> None:
    acl.assert_no_denials()  # the workers' start-up (the probes below are denied on purpose)
    port = acl.admin.connection_pool.connection_kwargs["port"]
    anonymous = Redis(host="127.0.0.1", port=port)
    with pytest.raises(RedisError, match="(?i)auth"):  # the default user is off
        anonymous.ping()
    client = acl.client.connection
    with pytest.raises(NoPermissionError):
        client.get("someone-else:key")  # outside the deployment's keys
    with pytest.raises(NoPermissionError):
        client.flushall()
    acl.admin.acl_log_reset()


def test_workers_listen_for_cancels_and_rq_commands(acl: AclDeployment) -> None:
    """Every worker holds the cancel pattern subscription, and rq's command channel."""
    worker_user = acl.fleet.settings.redis_url.split("//")[1].split(":")[0]
    listening = [c for c in acl.admin.client_list() if c["user"] == worker_user]
    assert sum(int(c["psub"]) for c in listening) == len(acl.workers)
    channels = {c.decode() for c in acl.admin.pubsub_channels("rq:pubsub:*")}
    assert {f"rq:pubsub:{acl.fleet.settings.keys.rq_worker(name)}" for name in acl.workers} <= (
        channels)
    acl.assert_no_denials()


def test_submit_and_stream(acl: AclDeployment) -> None:
    done = acl.cli("submit", "--model", MODEL_NAME, "--prompt-tokens", "5,6,7",
                   "--max-tokens", "12", "--stream", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["status"] == "finished" and len(result["tokens"]) == 12
    assert result["worker"] in acl.workers
    acl.assert_no_denials()


def _running(acl: AclDeployment, request: dict[str, object] = LONG,
             ) -> tuple[Iterator[object], str, str]:
    """Submit a job and read its stream until it is generating: (rest, job id, worker)."""
    handle = acl.client.submit(request)
    events = handle.stream(timeout=60)
    worker = None
    for event in events:
        if isinstance(event, ProgressEvent) and event.stage == "started":
            worker = event.worker
        if isinstance(event, TokenEvent) and event.index >= 2:
            break
    assert worker is not None
    return events, handle.job_id, worker


def test_a_cancel_reaches_a_running_job_by_pubsub(acl: AclDeployment) -> None:
    """Only the published message, no key: the key poll could never see this cancel, so a
    cancelled final proves the worker's pattern subscription delivered it."""
    events, job_id, _ = _running(acl)
    acl.client.connection.publish(acl.client.keys.cancel(job_id), 1)
    final = list(events)[-1]
    assert isinstance(final, FinalEvent) and final.status is JobStatus.CANCELLED
    assert len(final.tokens) < LONG["max_tokens"]
    acl.assert_no_denials()


def test_cancel_command_stops_a_running_job(acl: AclDeployment) -> None:
    events, job_id, _ = _running(acl)
    cancelled = acl.cli("cancel", job_id)
    assert cancelled.returncode == 0, cancelled.stderr
    final = list(events)[-1]
    assert isinstance(final, FinalEvent) and final.status is JobStatus.CANCELLED
    acl.assert_no_denials()


def test_batch(acl: AclDeployment, tmp_path: Path) -> None:
    lines = [{"custom_id": f"r{i}", "body": {"prompt_tokens": [3, i + 1], "max_tokens": 6}}
             for i in range(4)]
    requests = tmp_path / "in.jsonl"
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    done = acl.cli("batch", str(requests), "--model", MODEL_NAME, "--out", str(out),
                   "--timeout", "60")
    assert done.returncode == 0, done.stderr
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in results) == [f"r{i}" for i in range(4)]
    assert all(r["error"] is None for r in results)
    listed = acl.cli("batch", "list")
    assert listed.returncode == 0, listed.stderr
    acl.assert_no_denials()


def test_fleet(acl: AclDeployment) -> None:
    shown = acl.cli("fleet", "--json")
    assert shown.returncode == 0, shown.stderr
    assert {w["name"] for w in json.loads(shown.stdout)["workers"]} == set(acl.workers)
    top = acl.cli("top", "--once", "--json")
    assert top.returncode == 0, top.stderr
    acl.assert_no_denials()


def test_gateway(acl: AclDeployment, tmp_path: Path) -> None:
    """``specfleet serve`` as the client user: a completion, and the fleet's metrics."""
    gateway = Gateway(acl.client.settings, tmp_path).start()
    try:
        reply = httpx.post(gateway.url + "/v1/completions", timeout=60, json={
            "model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 6})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 6
        assert httpx.get(gateway.url + "/metrics", timeout=10).status_code == 200
    finally:
        gateway.stop()
    assert "NOPERM" not in gateway.log() and "Traceback" not in gateway.log()
    acl.assert_no_denials()


def test_recovery_after_kill_9(acl: AclDeployment) -> None:
    """The job of a killed worker is requeued (a sweep as the worker or client user) and
    finishes on the other one."""
    events, job_id, victim = _running(acl, {**LONG, "max_tokens": 40})
    acl.fleet.kill(victim)
    acl.fleet.procs[victim].wait(timeout=10)
    rest = list(events)
    final = rest[-1]
    assert isinstance(final, FinalEvent) and final.status is JobStatus.FINISHED
    assert final.worker != victim and final.attempt == 2
    assert any(isinstance(e, ProgressEvent) and e.stage == "requeued" for e in rest)
    acl.workers.remove(victim)
    acl.assert_no_denials()
