"""compose.yaml is a valid Compose file whose every specfleet command the CLI accepts, with
credentials in every REDIS_URL, persistence, and one reserved GPU per GPU worker."""

from __future__ import annotations

import os
import re
from typing import Any

import jsonschema
import pytest

from shared.sentinel import parse_sentinel_url
from shared.settings import Settings
from worker.launch import parse_device

from .cli import parse_specfleet
from .files import (
    COMPOSE,
    ROOT,
    MissingVariable,
    command_argv,
    compose_schema,
    compose_variables,
    dockerfile_stages,
    env_example,
    interpolate,
    raw_compose,
)

#: What an operator's .env holds (docker/env.example with the passwords filled in).
PASSWORDS = {"SPECFLEET_WORKER_PASSWORD": "w0rkerpw", "SPECFLEET_CLIENT_PASSWORD": "cl1entpw",
             "SPECFLEET_ADMIN_PASSWORD": "adm1npw"}


def _compose(env: dict[str, str] | None = None) -> dict[str, Any]:
    return interpolate(raw_compose(), {**env_example(), **PASSWORDS} if env is None else env)


def _validate(document: dict[str, Any]) -> None:
    schema = compose_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = sorted(validator.iter_errors(document), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
                                 for e in errors)


def test_compose_yaml_follows_the_compose_specification() -> None:
    _validate(raw_compose())
    _validate(_compose())  # and with the variables an operator's .env gives it


def test_the_schema_check_catches_a_misspelt_key() -> None:
    document = _compose()
    document["services"]["worker-cpu"]["stop_grace_periode"] = "60s"
    with pytest.raises(AssertionError, match="stop_grace_periode"):
        _validate(document)


def test_every_specfleet_command_is_one_the_cli_accepts() -> None:
    services = _compose()["services"]
    checked = []
    for name, service in services.items():
        if "build" not in service:
            continue  # not one of our images (redis)
        argv = command_argv(service["command"])
        params = parse_specfleet(argv)
        if params["command"] == "worker":
            parse_device(params["device"])
        checked.append(name)
    assert {"gateway", "worker-cpu", "worker-cuda0", "worker-cuda1", "client"} <= set(checked)


def test_every_service_environment_is_valid_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """What each container's process reads at start (shared.settings), from its environment."""
    for name, service in _compose()["services"].items():
        if "build" not in service:
            continue
        with monkeypatch.context() as patch:
            for key in [k for k in os.environ if k.startswith("SPECFLEET_") or k == "REDIS_URL"]:
                patch.delenv(key)
            for key, value in service["environment"].items():
                patch.setenv(key, str(value))
            settings = Settings()
        assert settings.redis_url == service["environment"]["REDIS_URL"], name
        assert (settings.prefix, settings.log_format) == ("specfleet", "json"), name


def test_the_passwords_are_required_and_the_env_example_names_every_variable() -> None:
    assert compose_variables() <= set(env_example()), (
        f"undocumented in docker/env.example: {compose_variables() - set(env_example())}")
    for missing in PASSWORDS:
        env = {**env_example(), **PASSWORDS, missing: ""}
        with pytest.raises(MissingVariable, match=missing):
            _compose(env)


def test_every_redis_url_logs_in_as_an_acl_user() -> None:
    services = _compose()["services"]
    urls = {name: s["environment"]["REDIS_URL"] for name, s in services.items()
            if "build" in s}
    assert len(urls) == 5
    for name, url in urls.items():
        match = re.fullmatch(r"redis://([\w.-]+):([^@]+)@redis:6379/0", url)
        assert match, f"{name}: REDIS_URL without credentials"
        role = "worker" if name.startswith("worker") else "client"
        assert match.groups() == (f"specfleet-{role}", PASSWORDS[f"SPECFLEET_{role.upper()}_"
                                                                 "PASSWORD"]), name
    template = (ROOT / "docker/redis/users.acl.template").read_text()
    assert "user ${SPECFLEET_PREFIX}-worker on" in template
    assert "user ${SPECFLEET_PREFIX}-client on" in template


def test_workers_on_other_hosts_reach_a_central_redis_or_its_sentinels() -> None:
    env = {**env_example(), **PASSWORDS, "SPECFLEET_REDIS_SCHEME": "redis+sentinel",
           "SPECFLEET_REDIS_ADDRESS": "s1:26379,s2:26380/mymaster"}
    url = _compose(env)["services"]["worker-cuda0"]["environment"]["REDIS_URL"]
    target = parse_sentinel_url(url)
    assert target.sentinels == (("s1", 26379), ("s2", 26380))
    assert (target.service, target.db, target.username, target.password) == (
        "mymaster", 0, "specfleet-worker", PASSWORDS["SPECFLEET_WORKER_PASSWORD"])
    env = {**env_example(), **PASSWORDS, "SPECFLEET_REDIS_SCHEME": "rediss",
           "SPECFLEET_REDIS_ADDRESS": "redis.internal:6380"}
    url = _compose(env)["services"]["gateway"]["environment"]["REDIS_URL"]
    assert url == "rediss://specfleet-client:cl1entpw@redis.internal:6380/0"


def test_redis_persists_to_a_volume_and_runs_on_the_shared_acl_file() -> None:
    redis = _compose()["services"]["redis"]
    volumes = {v.split(":")[1]: v.split(":")[0] for v in redis["volumes"]}
    assert volumes["/data"] in _compose()["volumes"]  # a named volume, not the container
    mounted = ROOT / volumes["/etc/specfleet/redis"]
    script = " ".join(redis["command"])
    for file in re.findall(r"/etc/specfleet/redis/([\w.-]+)", script):
        assert (mounted / file).is_file(), file
    assert "--aclfile" in script and "--dir /data" in script
    assert "users.acl.template" in script and "admin.acl.template" in script
    conf = (mounted / "redis.conf").read_text()
    assert re.search(r"^appendonly yes$", conf, re.M)
    assert "ports" not in redis  # reachable from the compose network only


def test_one_cpu_worker_by_default_and_one_reserved_gpu_per_gpu_worker() -> None:
    services = _compose()["services"]
    default = {n for n, s in services.items() if not s.get("profiles")}
    assert default == {"redis", "gateway", "worker-cpu"}
    gpu = {n: s for n, s in services.items() if "gpu" in s.get("profiles", [])}
    assert set(gpu) == {"worker-cuda0", "worker-cuda1"}
    reserved = []
    for service in gpu.values():
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        reserved += device["device_ids"]
        # the container sees only its reserved GPU, numbered 0 by CUDA and NVML alike
        assert parse_specfleet(command_argv(service["command"]))["device"] == "cuda:0"
        assert service["build"]["target"] == "worker-cuda"
    assert sorted(reserved) == ["0", "1"]
    for name in ["worker-cpu", *gpu]:
        assert services[name]["stop_grace_period"] == "120s", name
        assert services[name]["stop_signal"] == "SIGTERM", name
        assert "/models" in " ".join(services[name]["volumes"]), name


def test_every_build_target_is_a_stage_of_the_dockerfile() -> None:
    stages = dockerfile_stages()
    for name, service in _compose()["services"].items():
        if "build" in service:
            assert (ROOT / service["build"]["dockerfile"]).resolve() == (
                ROOT / "docker/Dockerfile").resolve()
            assert service["build"]["target"] in stages, name


def test_no_secret_is_written_into_the_compose_file() -> None:
    text = COMPOSE.read_text()
    assert not re.search(r"redis://[^$\s]*:[^$\s]+@", text)  # credentials only as ${...}
    for value in PASSWORDS.values():
        assert value not in text
