"""The compose Redis: docker/redis/render-acl.sh turns the shared ACL template into the file a
real redis-server loads with docker/redis/redis.conf (passwords required, AOF on)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from redis import Redis
from redis.exceptions import AuthenticationError, ResponseError

from .files import ROOT
from .redis_nodes import Node, redis_server, wait_until

RENDER = ROOT / "docker/redis/render-acl.sh"
TEMPLATES = [ROOT / "docker/redis/users.acl.template", ROOT / "docker/redis/admin.acl.template"]
CONF = ROOT / "docker/redis/redis.conf"
# Characters that break naive sed/awk substitution; the ACL file itself only forbids whitespace.
WORKER_PW = r"w&1|\x/y"
CLIENT_PW = "c$2{}"
ADMIN_PW = "adminpw"


def _render(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", str(RENDER), *map(str, TEMPLATES)], capture_output=True,
                          text=True, env={"PATH": os.environ["PATH"], **env})


def _env(**overrides: str) -> dict[str, str]:
    return {"SPECFLEET_PREFIX": "deploytest", "SPECFLEET_WORKER_PASSWORD": WORKER_PW,
            "SPECFLEET_CLIENT_PASSWORD": CLIENT_PW, "SPECFLEET_ADMIN_PASSWORD": ADMIN_PW,
            **overrides}


@pytest.mark.parametrize("variable", ["SPECFLEET_WORKER_PASSWORD", "SPECFLEET_CLIENT_PASSWORD",
                                      "SPECFLEET_ADMIN_PASSWORD"])
def test_a_missing_password_stops_the_render_naming_it_and_printing_nothing(
        variable: str) -> None:
    done = _render(_env(**{variable: ""}))
    assert done.returncode == 1 and done.stdout == ""
    assert f"{variable} is not set" in done.stderr
    assert WORKER_PW not in done.stderr and CLIENT_PW not in done.stderr
    assert ADMIN_PW not in done.stderr


def test_a_password_with_whitespace_is_refused() -> None:
    done = _render(_env(SPECFLEET_CLIENT_PASSWORD="two words"))
    assert done.returncode == 1 and "SPECFLEET_CLIENT_PASSWORD contains whitespace" in done.stderr
    assert "two words" not in done.stderr


@contextmanager
def _compose_redis(tmp_path: Path) -> Iterator[Node]:
    """redis-server as compose starts it: redis.conf, the rendered users, a data directory."""
    done = _render(_env())
    assert done.returncode == 0, done.stderr
    acl = tmp_path / "users.acl"
    acl.write_text(done.stdout)
    data = tmp_path / "data"
    data.mkdir()
    with redis_server(data, str(CONF), "--aclfile", str(acl), ready=False) as node:
        yield node


def test_redis_runs_the_rendered_users_with_persistence(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with _compose_redis(tmp_path) as node:
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


def test_a_password_is_rotated_without_dropping_a_connected_worker(tmp_path: Path) -> None:
    """docs/operations.md's rotation: the admin adds the new password, workers restart with it
    one by one, then the old one is removed; a connection opened earlier keeps working."""
    with _compose_redis(tmp_path) as node:
        def as_worker(password: str) -> Redis:
            return Redis(port=node.port, username="deploytest-worker", password=password)

        running = as_worker(WORKER_PW)
        running.set("deploytest:before", "1")
        admin = Redis(port=node.port, username="deploytest-admin", password=ADMIN_PW)
        # the commands the docs give (redis-cli ACL SETUSER ...): a password added, then removed
        admin.execute_command("ACL", "SETUSER", "deploytest-worker", ">new-worker-pw")
        assert as_worker("new-worker-pw").get("deploytest:before") == b"1"
        assert as_worker(WORKER_PW).ping()  # both work while the workers restart
        admin.execute_command("ACL", "SETUSER", "deploytest-worker", f"<{WORKER_PW}")
        with pytest.raises(AuthenticationError):
            as_worker(WORKER_PW).ping()
        running.set("deploytest:after", "2")  # authenticated before the change: still served
        assert as_worker("new-worker-pw").get("deploytest:after") == b"2"
        with pytest.raises(ResponseError, match="no permissions"):
            as_worker("new-worker-pw").execute_command("ACL", "SETUSER", "deploytest-client", ">x")
