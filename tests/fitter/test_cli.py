"""``specfleet fit`` as operators run it: a real subprocess, JSON or a table, clean refusals."""

from __future__ import annotations

import json
import subprocess

import pytest
from helpers import specfleet

from worker.llm.devices import has_local_gpu
from worker.testmodels import TinyModels


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return specfleet("fit", *args)


def test_json_report(tiny_models: TinyModels) -> None:
    proc = run("--model", str(tiny_models.dense), "--budget-mib", "3", "--fit-target-mib", "0.5",
               "--ctx-min", "256", "--spec", "ngram", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["n_ctx"] % 256 == 0 and report["n_ctx"] >= 256
    assert report["total_bytes"] == sum(report["components"].values())
    assert report["total_bytes"] <= (3 - 0.5) * 1024 * 1024
    assert set(report["components"]) >= {"weights", "kv", "recurrent", "snapshots", "compute",
                                          "draft", "checkpoint_reservation"}


def test_table_report(tiny_models: TinyModels) -> None:
    proc = run("--model", str(tiny_models.hybrid), "--budget-mib", "4", "--fit-target-mib", "0",
               "--ctx-min", "256", "--spec", "mtp", "--draft-max", "4", "--rollback-depth", "1")
    assert proc.returncode == 0, proc.stderr
    for row in ("weights", "snapshots", "checkpoint_reservation", "fitted n_ctx", "headroom"):
        assert row in proc.stdout


def test_a_fixed_context_is_checked_as_a_worker_would(tiny_models: TinyModels) -> None:
    proc = run("--model", str(tiny_models.dense), "--budget-mib", "8", "--fit-target-mib", "0",
               "--spec", "ngram", "--ctx", "600", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["n_ctx"] == 600 and report["details"]["n_ctx_source"] == "fixed"
    # Measuring never probes beyond the training context, so llama.cpp has nothing to warn of.
    assert "training context overflow" not in proc.stderr
    refused = run("--model", str(tiny_models.dense), "--ctx", "5000")
    assert refused.returncode == 2 and refused.stderr == (
        "specfleet: error: --ctx 5000 exceeds the model's training context (4096 tokens); "
        "pass --allow-ctx-above-train to run beyond it anyway\n")


def test_a_dense_models_table_shows_no_rollback_depth(tiny_models: TinyModels) -> None:
    proc = run("--model", str(tiny_models.dense), "--budget-mib", "3", "--fit-target-mib", "0",
               "--ctx-min", "256", "--spec", "ngram")
    assert proc.returncode == 0, proc.stderr
    assert "no rollback snapshots" in proc.stdout and "rollback_depth" not in proc.stdout


@pytest.mark.parametrize(("args", "reason"), [
    (["--budget-mib", "0.25"], "the weights do not fit"),
    (["--budget-mib", "3", "--ctx-min", "4096"], "(--ctx-min 4096) does not fit"),
    (["--draft-max", "2", "--rollback-depth", "3"], "rollback_depth"),
    # llama.cpp's n_ctx is a uint32: a larger --ctx would wrap silently.
    (["--ctx", "5000000000"], "Invalid value for '--ctx': Input should be less than or equal "
     "to 2147483647"),
    # Refused before any measurement: no GPU offload in this llama.cpp, or no such device.
    (["--device", "cuda:4096", "--budget-mib", "64"],
     "no GPU offload" if not has_local_gpu() else "no CUDA device"),
    # The default 1 GiB margin is named instead of a negative "available".
    (["--budget-mib", "3.5", "--fit-target-mib", "1024"], "the margin left free "
     "(--fit-target-mib, default 1024) is 1024.00 MiB of the 3.50 MiB free (budget)"),
])
def test_impossible_fit_exits_with_the_reason(tiny_models: TinyModels, args: list[str],
                                              reason: str) -> None:
    proc = run("--model", str(tiny_models.dense), "--fit-target-mib", "0", *args)
    assert proc.returncode != 0
    assert reason in proc.stderr and proc.stdout == ""
