"""The compose Redis: docker/redis/render-acl.sh turns the shared ACL template into the file a
real redis-server loads with docker/redis/redis.conf (passwords required, AOF on)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from redis import Redis
from redis.exceptions import AuthenticationError, ResponseError

from .files import ROOT
from .redis_nodes import redis_server, wait_until

RENDER = ROOT / "docker/redis/render-acl.sh"
TEMPLATE = ROOT / "docker/redis/users.acl.template"
CONF = ROOT / "docker/redis/redis.conf"
# Characters that break naive sed/awk substitution; the ACL file itself only forbids whitespace.
WORKER_PW = r"w&1|\x/y"
CLIENT_PW = "c$2{}"


def _render(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", str(RENDER), str(TEMPLATE)], capture_output=True, text=True,
                          env={"PATH": os.environ["PATH"], **env})


def _env(**overrides: str) -> dict[str, str]:
    return {"SPECFLEET_PREFIX": "deploytest", "SPECFLEET_WORKER_PASSWORD": WORKER_PW,
            "SPECFLEET_CLIENT_PASSWORD": CLIENT_PW, **overrides}


@pytest.mark.parametrize("variable", ["SPECFLEET_WORKER_PASSWORD", "SPECFLEET_CLIENT_PASSWORD"])
def test_a_missing_password_stops_the_render_naming_it_and_printing_nothing(
        variable: str) -> None:
    done = _render(_env(**{variable: ""}))
    assert done.returncode == 1 and done.stdout == ""
    assert f"{variable} is not set" in done.stderr
    assert WORKER_PW not in done.stderr and CLIENT_PW not in done.stderr


def test_a_password_with_whitespace_is_refused() -> None:
    done = _render(_env(SPECFLEET_CLIENT_PASSWORD="two words"))
    assert done.returncode == 1 and "SPECFLEET_CLIENT_PASSWORD contains whitespace" in done.stderr
    assert "two words" not in done.stderr


def test_redis_runs_the_rendered_users_with_persistence(tmp_path: Path) -> None:
    done = _render(_env())
    assert done.returncode == 0, done.stderr
    acl = tmp_path / "users.acl"
    acl.write_text(done.stdout)
    data = tmp_path / "data"
    data.mkdir()
    with redis_server(data, str(CONF), "--aclfile", str(acl), ready=False) as node:
        anonymous = Redis(port=node.port)
        with pytest.raises((AuthenticationError, ResponseError), match="NOAUTH|auth"):
            anonymous.set("deploytest:x", "1")
        with pytest.raises(AuthenticationError):
            Redis(port=node.port, username="deploytest-worker", password="wrong").ping()
        worker = Redis(port=node.port, username="deploytest-worker", password=WORKER_PW)
        worker.set("deploytest:x", "1")
        worker.rpush("rq:queue:deploytest:tiny", "job")
        with pytest.raises(ResponseError, match="no permissions"):
            worker.set("someone-else:x", "1")
        client = Redis(port=node.port, username="deploytest-client", password=CLIENT_PW)
        assert client.get("deploytest:x") == b"1"
        wait_until(lambda: any((data / "appendonlydir").glob("*.incr.aof")), 10,
                   "the append-only file")
    assert b"deploytest:x" in b"".join(p.read_bytes()
                                      for p in (data / "appendonlydir").glob("*.aof"))
