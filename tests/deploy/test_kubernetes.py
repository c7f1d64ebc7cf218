"""deploy/helm/specfleet rendered by the real helm over its values matrix (CPU and GPU workers,
the chart's Redis with ACL on and off, an external Redis, KEDA off, on Redis lists and on
Prometheus): every object validates against the Kubernetes schemas (and KEDA's CRDs), and the
rendered objects do what the chart says: probes, GPU requests, drains, secrets, scaling."""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from redis import Redis
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, ResponseError
from redis.retry import Retry
from rq.queue import Queue

from coordinator.gateway.cross_site import CROSS_SITE_EXEMPT
from coordinator.metrics import DEMAND_GAUGES
from coordinator.metrics import PREFIX as METRICS_PREFIX
from shared.keys import Keys
from shared.protocol import Priority
from shared.redis_client import connect
from shared.settings import Settings
from worker.launch import parse_device

from .chart import (
    CHART,
    EXAMPLES,
    NAMESPACE,
    container,
    expand_env,
    lint,
    objects,
    render,
    render_error,
    validate,
)
from .cli import parse_specfleet
from .files import ROOT, dockerfile_stages, raw_compose
from .redis_nodes import redis_server

ACL_SECRET = "specfleet-redis-acl"
PASSWORDS = {"worker": "w0rkerPw", "client": "cl1entPw", "admin": "adm1nPw"}
EXTERNAL_SECRET = yaml.safe_load((EXAMPLES / "external-redis.yaml").read_text())[
    "redis"]["external"]["existingSecret"]
EXTERNAL_URLS = {"worker": "rediss://specfleet-worker:xw@redis.internal:6380/0",
                 "client": "rediss://specfleet-client:xc@redis.internal:6380/0"}
#: What the cluster's Secrets hold, for expanding environments like the kubelet.
SECRETS = {**{(ACL_SECRET, f"{role}-password"): pw for role, pw in PASSWORDS.items()},
           **{(EXTERNAL_SECRET, f"{role}-url"): url for role, url in EXTERNAL_URLS.items()}}
ACL = {"redis__acl__existingSecret": ACL_SECRET}
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
CHART_META = yaml.safe_load((CHART / "Chart.yaml").read_text())
FULLNAME = "sf-specfleet"
REDIS_HOST = f"{FULLNAME}-redis.{NAMESPACE}.svc:6379"

#: The values matrix: example values files (deploy/helm/examples) and settings.
CASES: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "cpu": ((), ACL),
    "cpu-acl-off": ((), {"redis__acl__enabled": False}),
    "gpu": (("gpu.yaml",), ACL),
    "external-redis": (("external-redis.yaml",), {}),
    "keda-redis": (("keda.yaml", "gpu.yaml"), ACL),
    "keda-redis-acl-off": (("keda.yaml",), {"redis__acl__enabled": False}),
    "keda-redis-external": (("keda.yaml", "external-redis.yaml"), {}),
    "keda-prometheus": (("keda-prometheus.yaml", "gpu.yaml"), ACL),
}


@functools.cache
def _rendered(case: str) -> tuple[dict[str, Any], ...]:
    files, settings = CASES[case]
    return tuple(render(*files, **settings))


def rendered(case: str) -> list[dict[str, Any]]:
    """A deep copy of one case's objects (rendered once per session)."""
    return copy.deepcopy(list(_rendered(case)))


def workers(case: str) -> dict[str, dict[str, Any]]:
    """The worker Deployments of a case, by model name."""
    found = {}
    for deployment in objects(rendered(case), "Deployment").values():
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        if labels["app.kubernetes.io/component"] == "worker":
            found[parse_specfleet(container(deployment)["command"])["model_name"]] = deployment
    return found


def gateway(case: str) -> dict[str, Any]:
    return objects(rendered(case), "Deployment")[f"{FULLNAME}-gateway"]


def settings_of(spec: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """shared.settings as a container's process reads them from its environment."""
    with monkeypatch.context() as patch:
        for key in [k for k in os.environ if k.startswith("SPECFLEET_") or k == "REDIS_URL"]:
            patch.delenv(key)
        for key, value in expand_env(spec, SECRETS).items():
            patch.setenv(key, value)
        return Settings()


def all_containers(case: str) -> list[dict[str, Any]]:
    pods = [o["spec"]["template"]["spec"] for o in rendered(case)
            if o["kind"] in ("Deployment", "StatefulSet")]
    return [c for pod in pods for c in pod.get("initContainers", []) + pod["containers"]]


# --- every variant is valid Kubernetes --------------------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_every_object_validates_against_the_kubernetes_and_keda_schemas(case: str) -> None:
    files, settings = CASES[case]
    found = rendered(case)
    for obj in found:
        validate(obj)
    kinds = {o["kind"] for o in found}
    external = "external-redis.yaml" in files
    keda = any(f.startswith("keda") for f in files)
    assert {"Deployment", "Service", "PodDisruptionBudget"} <= kinds
    assert ("StatefulSet" in kinds) is (not external)  # the chart's own Redis, or none
    assert ("ConfigMap" in kinds) is (not external)
    assert ("ScaledObject" in kinds) is keda
    assert ("TriggerAuthentication" in kinds) is (keda and external
                                                  and "keda.yaml" in files)
    assert "Secret" not in kinds  # secrets are referenced, never written by the chart


def test_the_schema_checks_refuse_a_misspelt_field() -> None:
    deployment = copy.deepcopy(workers("keda-redis")["gemma-270m"])
    container(deployment)["readinessProbe"]["exce"] = {}
    with pytest.raises(AssertionError, match="'exce' was unexpected"):
        validate(deployment)
    scaled = copy.deepcopy(next(iter(objects(rendered("keda-redis"), "ScaledObject").values())))
    scaled["spec"]["triggers"][0]["metadata"]["listLength"] = 2  # KEDA wants strings
    with pytest.raises(AssertionError, match="listLength: 2 is not of type 'string'"):
        validate(scaled)
    scaled["spec"]["minReplicaCountt"] = 0
    with pytest.raises(AssertionError, match="'minReplicaCountt' was unexpected"):
        validate(scaled)


def test_helm_lint_passes_strictly() -> None:
    done = lint(**ACL)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 chart(s) failed" in done.stdout


def test_the_images_default_to_the_chart_app_version_which_is_the_package_version() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert CHART_META["appVersion"] == project["version"]
    images = {container(d)["image"] for d in objects(rendered("gpu"), "Deployment").values()}
    assert images == {f"specfleet-{image}:{project['version']}"
                      for image in ("gateway", "worker", "worker-cuda")}
    # the same Redis as compose.yaml runs
    redis = objects(rendered("gpu"), "StatefulSet")[f"{FULLNAME}-redis"]
    assert container(redis)["image"] == raw_compose()["services"]["redis"]["image"]


# --- workers ------------------------------------------------------------------------------

def test_cpu_and_gpu_workers_run_a_command_the_cli_accepts_on_their_device() -> None:
    found = workers("gpu")
    models = {m["name"]: m for m in yaml.safe_load((EXAMPLES / "gpu.yaml").read_text())["models"]}
    assert set(found) == set(models) == {"gemma-270m", "qwen3-8b"}
    for name, deployment in found.items():
        spec = container(deployment)
        params = parse_specfleet(spec["command"])
        device = parse_device(params["device"])
        limits = spec["resources"].get("limits", {})
        pod = deployment["spec"]["template"]["spec"]
        assert params["model"] == Path(models[name]["file"])
        assert params["metrics_port"] == VALUES["worker"]["metricsPort"]
        assert params["slots"] == str(models[name].get("slots", 1))
        assert {"name": "metrics", "containerPort": params["metrics_port"]} in spec["ports"]
        if models[name]["device"] == "gpu":
            # one GPU, which the pod sees as its only one: cuda:0 for CUDA and NVML alike
            assert device.is_cuda and params["device"] == "cuda:0"
            assert limits["nvidia.com/gpu"] == 1
            assert spec["image"].startswith("specfleet-worker-cuda:")
            assert {"key": "nvidia.com/gpu", "operator": "Exists",
                    "effect": "NoSchedule"} in pod["tolerations"]
            assert pod["nodeSelector"] == models[name]["nodeSelector"]
            # no spare GPU to surge onto: replaced in place
            assert deployment["spec"]["strategy"]["rollingUpdate"] == {
                "maxSurge": 0, "maxUnavailable": 1}
            assert Path(params["model"]).is_relative_to("/models")
        else:
            assert not device.is_cuda and params["threads"] == models[name]["threads"]
            assert "nvidia.com/gpu" not in limits
            assert spec["image"].startswith("specfleet-worker:")
            assert "tolerations" not in pod
            assert deployment["spec"]["strategy"]["rollingUpdate"] == {
                "maxSurge": 1, "maxUnavailable": 0}
        assert deployment["spec"]["replicas"] == models[name]["replicas"]  # KEDA off
        assert spec["resources"]["requests"] == models[name]["resources"]["requests"]
        # the model volume, read-only at /models in every worker
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in spec[
            "volumeMounts"]
        (volume,) = pod["volumes"]
        assert volume["persistentVolumeClaim"] == {"claimName": "specfleet-models",
                                                   "readOnly": True}
    assert "volumes" not in workers("cpu")["gemma-270m"]["spec"]["template"]["spec"]


def test_a_worker_is_ready_once_registered_and_is_given_its_longest_job_to_drain() -> None:
    """Readiness is the images' own health check: a live registration in the fleet, written
    after the worker fitted its context, reserved its memory and loaded the model."""
    stages = dockerfile_stages()
    image_check, cuda_check = (stages[s].last("HEALTHCHECK").exec_form()  # type: ignore[union-attr]
                               for s in ("worker", "worker-cuda"))
    assert image_check == cuda_check
    models = {m["name"]: m for m in yaml.safe_load((EXAMPLES / "gpu.yaml").read_text())["models"]}
    defaults = VALUES["worker"]
    for name, deployment in workers("gpu").items():
        spec = container(deployment)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert spec[probe]["exec"]["command"] == image_check, probe
        startup = spec["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= defaults["startupSeconds"]
        # liveness outlasts a Redis outage, which the worker waits out by itself
        live = spec["livenessProbe"]
        assert live["periodSeconds"] * live["failureThreshold"] > Settings().redis_outage_seconds
        # SIGTERM is the drain: no preStop hook that would make the kubelet's the second one
        assert "lifecycle" not in spec
        longest = models[name].get("longestJobSeconds", defaults["longestJobSeconds"])
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace == longest + defaults["drainMarginSeconds"] > longest
    assert image_check == ["python", "/opt/specfleet/healthcheck.py", "worker"]


def test_every_budget_service_and_scaler_targets_pods_the_chart_renders() -> None:
    for case in CASES:
        found = rendered(case)
        pods = {(o["kind"], o["metadata"]["name"]): o["spec"]["template"]["metadata"]["labels"]
                for o in found if o["kind"] in ("Deployment", "StatefulSet")}
        for obj in found:
            if obj["kind"] not in ("PodDisruptionBudget", "Service"):
                continue
            selector = obj["spec"]["selector"]
            selector = selector.get("matchLabels", selector)
            chosen = [k for k, labels in pods.items() if selector.items() <= labels.items()]
            assert len(chosen) == 1, f"{case}: {obj['kind']}/{obj['metadata']['name']}"
        budgets = objects(found, "PodDisruptionBudget")
        for kind, name in pods:
            if kind == "Deployment":
                assert budgets[name]["spec"] == {"maxUnavailable": 1, "selector": {
                    "matchLabels": objects(found, kind)[name]["spec"]["selector"][
                        "matchLabels"]}}


# --- the gateway --------------------------------------------------------------------------

def test_the_gateway_is_probed_on_health_and_drains_behind_its_service(
        monkeypatch: pytest.MonkeyPatch) -> None:
    deployment = gateway("cpu")
    spec = container(deployment)
    params = parse_specfleet(spec["command"])
    assert (params["command"], params["host"]) == ("serve", "0.0.0.0")
    assert spec["ports"] == [{"name": "http", "containerPort": params["port"]}]
    assert spec["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    # probed by pod address: /health answers whatever the Host header names
    assert "/health" in CROSS_SITE_EXEMPT
    assert spec["livenessProbe"]["tcpSocket"] == {"port": "http"}  # not restarted for Redis
    settings = VALUES["gateway"]
    assert spec["lifecycle"]["preStop"]["exec"]["command"] == [
        "sleep", str(settings["preStopSeconds"])]
    env = expand_env(spec, SECRETS)
    assert env["SPECFLEET_DRAIN_SECONDS"] == str(settings["drainSeconds"])
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > settings["preStopSeconds"] + settings["drainSeconds"]
    service = objects(rendered("cpu"), "Service")[f"{FULLNAME}-gateway"]
    assert service["spec"]["ports"] == [{"name": "http", "port": params["port"],
                                         "targetPort": "http"}]
    assert deployment["spec"]["replicas"] == settings["replicas"]
    assert settings_of(spec, monkeypatch).prefix == VALUES["prefix"]


def test_api_keys_come_from_their_secret() -> None:
    spec = container(objects(render(**ACL, gateway__apiKeysSecret="gw-keys"),
                             "Deployment")[f"{FULLNAME}-gateway"])
    entries = {e["name"]: e for e in spec["env"]}
    assert entries["SPECFLEET_API_KEYS"]["valueFrom"]["secretKeyRef"] == {
        "name": "gw-keys", "key": "api-keys"}
    assert entries["SPECFLEET_ADMIN_API_KEYS"]["valueFrom"]["secretKeyRef"] == {
        "name": "gw-keys", "key": "admin-api-keys", "optional": True}
    assert "SPECFLEET_API_KEYS" not in {e["name"] for e in container(gateway("cpu"))["env"]}


# --- Redis: ACL on, off, external ---------------------------------------------------------

def test_with_acl_every_process_logs_in_as_its_own_user_from_the_secret(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for role, spec in (("worker", container(workers("gpu")["qwen3-8b"])),
                       ("client", container(gateway("gpu")))):
        password = next(e for e in spec["env"] if e["name"] == "REDIS_PASSWORD")
        assert password["valueFrom"]["secretKeyRef"] == {"name": ACL_SECRET,
                                                         "key": f"{role}-password"}
        url = settings_of(spec, monkeypatch).redis_url
        assert url == f"redis://specfleet-{role}:{PASSWORDS[role]}@{REDIS_HOST}/0"


def test_the_redis_pod_serves_the_acl_users_it_renders(tmp_path: Path) -> None:
    """The StatefulSet's init container and Redis command, run as written (the ConfigMap's
    files at their mount path, the Secret's passwords in their environment), then the worker's
    and the gateway's REDIS_URL and Redis's own readiness probe against it."""
    found = rendered("cpu")
    files = objects(found, "ConfigMap")[f"{FULLNAME}-redis"]["data"]
    pod = objects(found, "StatefulSet")[f"{FULLNAME}-redis"]["spec"]["template"]["spec"]
    mounts = {"/etc/specfleet/redis": tmp_path / "config", "/run/specfleet": tmp_path / "run",
              "/data": tmp_path / "data"}
    for directory in mounts.values():
        directory.mkdir()
    for name, text in files.items():
        (mounts["/etc/specfleet/redis"] / name).write_text(text)

    def local(text: str) -> str:
        for mount, directory in mounts.items():
            text = text.replace(mount, str(directory))
        return text

    (init,) = pod["initContainers"]
    env = {"PATH": os.environ["PATH"], **expand_env(init, SECRETS)}
    done = subprocess.run([*init["command"], *map(local, init["args"])], env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    redis = container({"spec": {"template": {"spec": pod}}}, "redis")
    assert redis["command"][0] == "redis-server" and "--aclfile" in redis["command"]
    with redis_server(mounts["/data"], *map(local, redis["command"][1:]), ready=False) as node:
        for role, spec in (("worker", container(workers("cpu")["gemma-270m"])),
                           ("client", container(gateway("cpu")))):
            url = expand_env(spec, SECRETS)["REDIS_URL"].replace(REDIS_HOST,
                                                                 f"127.0.0.1:{node.port}")
            connection = connect(url)
            connection.rpush("rq:queue:specfleet:gemma-270m", "job")  # what both roles do
            with pytest.raises(ResponseError, match="no permissions"):
                connection.set("otherdeployment:x", "1")
            # rq's command channel is the worker user's alone
            if role == "worker":
                connection.publish("rq:pubsub:specfleet:w1", "{}")
            else:
                with pytest.raises(ResponseError, match="no permissions"):
                    connection.publish("rq:pubsub:specfleet:w1", "{}")
        with pytest.raises((AuthenticationError, ResponseError), match="NOAUTH|auth"):
            Redis(port=node.port, retry=Retry(NoBackoff(), 0)).set("specfleet:x", "1")
        probe = redis["readinessProbe"]["exec"]["command"]
        probe_env = {"PATH": os.environ["PATH"], **expand_env(redis, SECRETS)}
        ready = subprocess.run([*probe[:-1], probe[-1].replace("-p 6379", f"-p {node.port}")],
                               env=probe_env, capture_output=True, text=True, timeout=30)
        assert ready.returncode == 0, ready.stdout + ready.stderr
        probe_env["REDISCLI_AUTH"] = "wrong"
        refused = subprocess.run([*probe[:-1], probe[-1].replace("-p 6379", f"-p {node.port}")],
                                 env=probe_env, capture_output=True, text=True, timeout=30)
        assert refused.returncode != 0


def test_with_acl_off_nothing_reads_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    found = rendered("cpu-acl-off")
    for spec in all_containers("cpu-acl-off"):
        assert all("valueFrom" not in e for e in spec.get("env", [])), spec["name"]
    redis = objects(found, "StatefulSet")[f"{FULLNAME}-redis"]["spec"]["template"]["spec"]
    assert "initContainers" not in redis and "--aclfile" not in redis["containers"][0]["command"]
    for spec in (container(gateway("cpu-acl-off")),
                 container(workers("cpu-acl-off")["gemma-270m"])):
        assert settings_of(spec, monkeypatch).redis_url == f"redis://{REDIS_HOST}/0"


def test_an_external_redis_is_reached_by_the_urls_in_its_secret(
        monkeypatch: pytest.MonkeyPatch) -> None:
    found = rendered("external-redis")
    assert not [o for o in found if "redis" in o["metadata"]["name"]]
    for role, spec in (("worker", container(workers("external-redis")["gemma-270m"])),
                       ("client", container(gateway("external-redis")))):
        entries = {e["name"]: e for e in spec["env"]}
        assert entries["REDIS_URL"]["valueFrom"]["secretKeyRef"] == {
            "name": EXTERNAL_SECRET, "key": f"{role}-url"}
        assert "REDIS_ADDRESS" not in entries
        assert settings_of(spec, monkeypatch).redis_url == EXTERNAL_URLS[role]


def test_no_secret_is_written_into_a_plain_environment_value() -> None:
    credentials = re.compile(r"://([^/@\s]*)@")
    for case in CASES:
        for spec in all_containers(case):
            for entry in spec.get("env", []):
                name, value = entry["name"], entry.get("value")
                if re.search(r"PASSWORD|API_KEYS|AUTH", name):
                    assert "secretKeyRef" in entry["valueFrom"], (case, name)
                if value is not None and (userinfo := credentials.search(value)):
                    # only references to variables that themselves come from a Secret
                    assert re.fullmatch(r"(\$\([A-Z_]+\):?)+", userinfo[1]), (case, name)


# --- KEDA -----------------------------------------------------------------------------------

def _queue_lists(model: str, tiers: list[int]) -> set[str]:
    """rq's list of every queue a job of ``model`` waits on while no worker holds it."""
    keys = Keys(VALUES["prefix"])
    return {Queue.redis_queue_namespace_prefix + keys.queue(model, priority, tier)
            for priority in Priority for tier in (None, *tiers)}


def test_keda_scales_each_model_from_zero_on_its_queue_lists() -> None:
    found = rendered("keda-redis")
    scaled = objects(found, "ScaledObject")
    models = {m["name"]: m for m in yaml.safe_load((EXAMPLES / "gpu.yaml").read_text())["models"]}
    keda = yaml.safe_load((EXAMPLES / "keda.yaml").read_text())["keda"]
    for name, deployment in workers("keda-redis").items():
        target = deployment["metadata"]["name"]
        spec = scaled[target]["spec"]
        assert spec["scaleTargetRef"] == {"name": target}
        assert "replicas" not in deployment["spec"]  # KEDA owns the count
        assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (
            0, keda["maxReplicaCount"])
        assert {t["type"] for t in spec["triggers"]} == {"redis"}
        lists = {t["metadata"]["listName"] for t in spec["triggers"]}
        assert lists == _queue_lists(name, models[name].get("contextTiers", []))
        env = {e["name"] for e in container(deployment)["env"]}
        for trigger in spec["triggers"]:
            metadata = trigger["metadata"]
            # a replica per `slots` queued jobs: what one worker runs at once
            assert metadata["listLength"] == str(models[name].get("slots", 1))
            assert metadata["activationListLength"] == "0"  # one job wakes the model
            # KEDA connects with the worker's own variables
            assert {metadata[k] for k in metadata if k.endswith("FromEnv")} == {
                "REDIS_ADDRESS", "REDIS_USERNAME", "REDIS_PASSWORD"} <= env
    assert _queue_lists("qwen3-8b", [8192]) >= {"rq:queue:specfleet:qwen3-8b",
                                                "rq:queue:specfleet:qwen3-8b:ctx8192:high"}
    (trigger, *_) = next(iter(objects(rendered("keda-redis-acl-off"),
                                      "ScaledObject").values()))["spec"]["triggers"]
    assert {k for k in trigger["metadata"] if k.endswith("FromEnv")} == {"addressFromEnv"}


def test_keda_reads_an_external_redis_with_the_secrets_credentials() -> None:
    found = rendered("keda-redis-external")
    (auth,) = objects(found, "TriggerAuthentication").values()
    assert auth["spec"]["secretTargetRef"] == [
        {"parameter": p, "name": EXTERNAL_SECRET, "key": f"keda-{p}"}
        for p in ("address", "username", "password")]
    for scaled in objects(found, "ScaledObject").values():
        for trigger in scaled["spec"]["triggers"]:
            assert trigger["authenticationRef"] == {"name": auth["metadata"]["name"]}
            assert not [k for k in trigger["metadata"] if k.endswith("FromEnv")]
            assert trigger["metadata"]["enableTLS"] == "false"


def test_keda_on_prometheus_reads_a_demand_gauge_of_the_gateways() -> None:
    found = rendered("keda-prometheus")
    prometheus = yaml.safe_load((EXAMPLES / "keda-prometheus.yaml").read_text())["keda"][
        "prometheus"]
    models = {m["name"]: m for m in yaml.safe_load((EXAMPLES / "gpu.yaml").read_text())["models"]}
    schema = json.loads((CHART / "values.schema.json").read_text())
    gauges = schema["properties"]["keda"]["properties"]["prometheus"]["properties"]["gauge"]
    assert set(gauges["enum"]) <= set(DEMAND_GAUGES)  # gauges the gateway really serves
    for name, deployment in workers("keda-prometheus").items():
        (trigger,) = objects(found, "ScaledObject")[deployment["metadata"]["name"]]["spec"][
            "triggers"]
        assert trigger["type"] == "prometheus"
        # every gateway reports the same fleet-wide value: max, never sum
        gauge = f"{METRICS_PREFIX}model_{prometheus['gauge']}"
        assert trigger["metadata"] == {
            "serverAddress": prometheus["serverAddress"],
            "query": f'max({gauge}{{model="{name}"}})',
            "threshold": str(models[name].get("slots", 1)), "activationThreshold": "0"}


@pytest.mark.parametrize(("case", "extra", "queues"), [
    ("cpu", {}, "true"),  # no KEDA: a fixed fleet, submits need a live worker
    ("keda-redis", {}, "false"),  # from zero on the lists: queued where KEDA reads them
    ("keda-redis", {"keda__minReplicaCount": 1}, "true"),
    ("keda-prometheus", {}, "true"),  # waiting in the gateway is in the demand gauge
])
def test_the_gateway_queues_requests_for_a_model_scaled_to_zero(
        case: str, extra: dict[str, Any], queues: str, monkeypatch: pytest.MonkeyPatch) -> None:
    files, settings = CASES[case]
    found = render(*files, **settings, **extra) if extra else rendered(case)
    spec = container(objects(found, "Deployment")[f"{FULLNAME}-gateway"])
    assert expand_env(spec, SECRETS)["SPECFLEET_REQUIRE_LIVE_WORKER"] == queues
    assert settings_of(spec, monkeypatch).require_live_worker is (queues == "true")


def test_one_model_scaled_to_zero_is_enough_for_the_gateway_to_queue() -> None:
    models = [{"name": "a", "file": "/models/a.gguf", "device": "cpu"},
              {"name": "b", "file": "/models/b.gguf", "device": "cpu",
               "keda": {"minReplicaCount": 0}}]
    found = render("keda.yaml", **ACL, keda__minReplicaCount=1, models=models)
    spec = container(objects(found, "Deployment")[f"{FULLNAME}-gateway"])
    assert expand_env(spec, SECRETS)["SPECFLEET_REQUIRE_LIVE_WORKER"] == "false"
    mins = {s["metadata"]["name"]: s["spec"]["minReplicaCount"]
            for s in objects(found, "ScaledObject").values()}
    assert mins == {f"{FULLNAME}-worker-a": 1, f"{FULLNAME}-worker-b": 0}


# --- bad values are refused at the edge, naming the field ------------------------------------

@pytest.mark.parametrize(("values", "message"), [
    ({"gateway__replicass": 3}, "replicass"),
    ({"models": [{"name": "m", "file": "/m.gguf", "device": "tpu"}]}, "models.0.device"),
    ({"models": [{"name": "m", "file": "/m.gguf", "device": "cpu",
                  "args": ["--device", "cuda:1"]}]}, "models.0.args.0"),
    ({"models": [{"name": "m", "file": "/m.gguf", "device": "cpu",
                  "args": ["--ctx", "512", "--slots=2"]}]}, "models.0.args.2"),
    ({"worker__env": {"REDIS_URL": "redis://elsewhere"}}, "worker.env"),
    ({"models": [{"name": "a.b", "file": "/a.gguf", "device": "cpu"},
                 {"name": "a_b", "file": "/b.gguf", "device": "cpu"}]},
     'the same Kubernetes name "a-b"'),
    ({"keda__enabled": True, "keda__minReplicaCount": 5}, "minReplicaCount 5 is above"),
    ({"keda__enabled": True, "keda__trigger": "prometheus"}, "keda.prometheus.serverAddress"),
    ({"redis__acl__existingSecret": ""}, "redis.acl.existingSecret"),
    ({"redis__external__enabled": True}, "redis.external.existingSecret"),
])
def test_bad_values_are_refused_naming_the_field(values: dict[str, Any], message: str) -> None:
    assert message in render_error(**{**ACL, **values})
