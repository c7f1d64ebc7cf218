"""Rendering deploy/helm/specfleet with the real ``helm`` and checking what it renders the way
the cluster would: every object against the Kubernetes API schemas (kubernetes-validate, strict),
KEDA's objects against KEDA's CRD models, container environments expanded like the kubelet."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from .files import ROOT

CHART = ROOT / "deploy" / "helm" / "specfleet"
EXAMPLES = ROOT / "deploy" / "helm" / "examples"
INSTALL_HELM = ROOT / "deploy" / "install_helm.py"
#: The Kubernetes release the manifests are validated against: the chart's kubeVersion floor.
KUBE_VERSION = "1.30.0"
RELEASE, NAMESPACE = "sf", "inference"


@functools.cache
def helm() -> str:
    """The helm binary (the venv's, from deploy/install_helm.py, else PATH). Missing: CI fails
    (.ci/run installs it), elsewhere the test skips saying how to install it."""
    found = shutil.which("helm", path=f"{Path(sys.executable).parent}{os.pathsep}"
                                       f"{os.environ.get('PATH', '')}")
    if found is None:
        script = INSTALL_HELM.relative_to(ROOT)
        message = f"no helm binary: install it with `.venv/bin/python {script}`"
        if os.environ.get("CI"):
            pytest.fail(f"{message} (.ci/run does)")
        pytest.skip(message)
    return found


def _helm_template(values_files: tuple[str, ...], settings: Mapping[str, object]
                   ) -> subprocess.CompletedProcess[str]:
    argv = [helm(), "template", RELEASE, str(CHART), "--namespace", NAMESPACE,
            "--kube-version", KUBE_VERSION]
    for name in values_files:
        argv += ["-f", str(EXAMPLES / name)]
    for key, value in settings.items():
        argv += ["--set-json", f"{key}={json.dumps(value)}"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def render(*values_files: str, **settings: object) -> list[dict[str, Any]]:
    """The chart's objects for ``helm template`` with these example values files (under
    deploy/helm/examples) and ``--set-json key=value`` settings (``settings`` keys with ``__``
    for dots: ``redis__acl__enabled=False``)."""
    done = _helm_template(values_files, {k.replace("__", "."): v for k, v in settings.items()})
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def render_error(*values_files: str, **settings: object) -> str:
    """What ``helm template`` says when it refuses the values (it must)."""
    done = _helm_template(values_files, {k.replace("__", "."): v for k, v in settings.items()})
    assert done.returncode != 0, "helm rendered values it should refuse"
    return done.stderr


def lint(**settings: object) -> subprocess.CompletedProcess[str]:
    argv = [helm(), "lint", "--strict", str(CHART), "--namespace", NAMESPACE,
            "--kube-version", KUBE_VERSION]
    for key, value in settings.items():
        argv += ["--set-json", f"{key.replace('__', '.')}={json.dumps(value)}"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def objects(rendered: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    """The rendered objects of one kind, by name."""
    found = {o["metadata"]["name"]: o for o in rendered if o["kind"] == kind}
    assert len(found) == sum(o["kind"] == kind for o in rendered), f"two {kind}s share a name"
    return found


def container(workload: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    containers = workload["spec"]["template"]["spec"]["containers"]
    return containers[0] if name is None else next(c for c in containers if c["name"] == name)


# --- schemas ------------------------------------------------------------------------------

def _strict(schema: Any) -> Any:
    """``schema`` with every object that lists its properties closed to others (pydantic's
    models allow extra keys; the CRD's structural schema prunes them, silently)."""
    if isinstance(schema, dict):
        closed = {k: _strict(v) for k, v in schema.items()}
        if "properties" in closed and "additionalProperties" not in closed:
            closed["additionalProperties"] = False
        return closed
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.cache
def keda_validator(kind: str) -> jsonschema.protocols.Validator:
    """A JSON-schema validator for a KEDA kind, from the models generated from KEDA 2.16's
    CRDs (cloudcoil-models-keda), closed to unknown fields."""
    from cloudcoil.models.keda import v1alpha1

    model = getattr(v1alpha1, kind)
    schema = _strict(model.model_json_schema(by_alias=True, mode="validation"))
    return jsonschema.Draft202012Validator(schema)


def validate(obj: dict[str, Any]) -> None:
    """Raise unless ``obj`` is a valid object of its kind: Kubernetes' own kinds against the
    API schemas of :data:`KUBE_VERSION` (strict: an unknown field is an error), KEDA's
    against its CRD models."""
    if obj["apiVersion"].startswith("keda.sh/"):
        errors = sorted(keda_validator(obj["kind"]).iter_errors(obj), key=lambda e: e.path)
        if errors:
            raise AssertionError("; ".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
                                           for e in errors))
        return
    try:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = "/".join(map(str, exc.absolute_path))
        raise AssertionError(f"{obj['kind']}/{obj['metadata']['name']} {path}: "
                             f"{exc.message}") from None


# --- the kubelet's view of a container's environment ---------------------------------------

_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand_env(spec: dict[str, Any], secrets: Mapping[tuple[str, str], str]) -> dict[str, str]:
    """A container's environment as its process sees it: ``secretKeyRef``s read from
    ``secrets`` ((secret, key) -> value; an optional missing key is left out, a required one
    fails) and ``$(VAR)`` replaced by a variable defined earlier in the list, as the kubelet
    does (``$$`` is a literal ``$``; an unknown reference stays as written)."""
    env: dict[str, str] = {}
    for entry in spec.get("env", []):
        if "valueFrom" in entry:
            ref = entry["valueFrom"]["secretKeyRef"]
            key = (ref["name"], ref["key"])
            if key not in secrets:
                assert ref.get("optional"), f"{entry['name']}: no Secret value {key}"
                continue
            env[entry["name"]] = secrets[key]
            continue

        def substitute(match: re.Match[str]) -> str:
            if match[0] == "$$":
                return "$"
            return env.get(match[1], match[0])

        env[entry["name"]] = _REFERENCE.sub(substitute, entry.get("value", ""))
    return env
