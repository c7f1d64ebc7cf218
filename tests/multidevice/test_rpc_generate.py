"""``specfleet generate`` over a device group: the host plus RPC devices, each a separate
process holding its own share of the model, gives the one-device output token for token.

The tiny models are F32, so a split changes no product's rounding: greedy output over 2 or
3 devices, in either order, or all on one RPC device (``--split-mode none``), must equal
the host alone, for the dense model and for the hybrid with an MTP head and compact
rollback (D < N: its checkpoints live on the device of the recurrent layers). Flags a group
cannot honour are refused before anything loads, naming the flag.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import PROMPT, free_port, specfleet

from worker.testmodels import TinyModels

from .devices import needs_rpc, rpc_devices

pytestmark = needs_rpc

#: What each model is run with: its drafter, and for the hybrid compact rollback (D < N).
RUNS = {"dense": ("--spec", "ngram", "--draft-max", "4"),
        "hybrid": ("--spec", "mtp", "--draft-max", "3", "--rollback-depth", "1")}


@pytest.fixture(scope="module")
def devices(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    with rpc_devices(3, tmp_path_factory.mktemp("rpc")) as endpoints:
        yield endpoints


def generate(model: Path, run: tuple[str, ...], *group: str) -> dict:
    proc = specfleet("generate", "--model", str(model), "--prompt-tokens",
                     ",".join(map(str, PROMPT)), "--max-tokens", "32", "--ctx", "256",
                     "--threads", "1", "--json", *run, *group)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("which", sorted(RUNS))
def test_a_group_generates_what_one_device_does(tiny_models: TinyModels, devices: list[str],
                                                which: str) -> None:
    model, run = getattr(tiny_models, which), RUNS[which]
    alone = generate(model, run)
    assert len(alone["tokens"]) == 32 and alone["telemetry"]["drafted"] > 0
    groups = [("--rpc", ",".join(devices[:2])),
              ("--rpc", ",".join(reversed(devices))),
              ("--rpc", ",".join(devices[:2]), "--split-mode", "none")]
    for group in groups:
        assert generate(model, run, *group)["tokens"] == alone["tokens"], group


@pytest.mark.parametrize(("args", "message"), [
    (("--rpc", "127.0.0.1:5001", "--split-mode", "none"),
     "--split-mode none needs a group of two or more devices"),
    (("--rpc", "127.0.0.1:5001,127.0.0.1:5002", "--split-mode", "row"),
     "--split-mode row splits matrix rows over CUDA devices only: RPC[127.0.0.1:5001], "
     "RPC[127.0.0.1:5002] cannot take rows"),
    (("--rpc", "127.0.0.1:5001,127.0.0.1:5002", "--tensor-split", "1,1,1"),
     "--tensor-split has 3 value(s) for 2 device(s) that take layers"),
    (("--rpc", "127.0.0.1:5001,127.0.0.1:5002", "--split-mode", "none", "--tensor-split", "1,1"),
     "--tensor-split does not apply with --split-mode none"),
    (("--rpc", "127.0.0.1:5001,127.0.0.1:5002", "--tensor-split", "0,0"),
     "--tensor-split takes non-negative proportions, not all zero"),
    (("--rpc", "127.0.0.1:5001,127.0.0.1:5001"), "--rpc lists 127.0.0.1:5001 twice"),
    (("--rpc", "127.0.0.1"), "--rpc takes HOST:PORT"),
    (("--device", "cpu,cuda:0"), "cpu cannot be listed with CUDA devices"),
    (("--split-mode", "diagonal"), "--split-mode must be layer, row or none"),
])
def test_what_a_group_cannot_honour_is_refused(tiny_models: TinyModels, args: tuple[str, ...],
                                               message: str) -> None:
    proc = specfleet("generate", "--model", str(tiny_models.dense), "--prompt-tokens", "1,2",
                     "--max-tokens", "2", *args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert message in proc.stderr, proc.stderr


def test_an_unreachable_device_is_refused_by_name(tiny_models: TinyModels) -> None:
    """llama.cpp's RPC client aborts the process on a refused connection: checked first."""
    port = free_port()  # nothing listens there
    proc = specfleet("generate", "--model", str(tiny_models.dense), "--prompt-tokens", "1,2",
                     "--max-tokens", "2", "--rpc", f"127.0.0.1:{port}")
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"specfleet: error: cannot reach the RPC device at "
                                  f"127.0.0.1:{port} (--rpc)"), proc.stderr
