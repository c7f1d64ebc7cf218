"""``specfleet fit`` over a device group: every device measured, fitted and reported.

Two RPC devices plus the host, each a separate process. The report has a column per
device in the model's order (the host first), every component on the device llama.cpp puts
it, every device within its own budget; reversing the order reverses the split,
``--split-mode none`` puts the whole model on the first device, a smaller budget on one
device shrinks the context, and a budget one device cannot meet is refused naming it and
the shortfall.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import specfleet

from worker.testmodels import TinyModels

from .devices import needs_rpc, rpc_devices

pytestmark = needs_rpc

MIB = 1024 * 1024
#: The hybrid with its MTP head and compact rollback: every component is non-zero somewhere.
HYBRID = ("--spec", "mtp", "--draft-max", "3", "--rollback-depth", "1")


@pytest.fixture(scope="module")
def devices(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    with rpc_devices(2, tmp_path_factory.mktemp("rpc")) as endpoints:
        yield endpoints


def fit(model: Path, *args: str) -> dict:
    proc = specfleet("fit", "--model", str(model), "--fit-target-mib", "0", "--ctx-min", "256",
                     "--threads", "1", "--json", *args)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def per_device(report: dict, key: str) -> list[int]:
    return [d["components"][key] for d in report["devices"]]


def test_the_report_lists_every_device_within_its_budget(tiny_models: TinyModels,
                                                         devices: list[str]) -> None:
    report = fit(tiny_models.hybrid, *HYBRID, "--rpc", ",".join(devices),
                 "--budget-mib", "8,24,24")
    names = [d["device"] for d in report["devices"]]
    assert names == ["cpu", *(f"RPC0[{e}]" for e in devices)]
    for device, budget in zip(report["devices"], (8, 24, 24), strict=True):
        assert device["free_bytes"] == budget * MIB
        assert 0 < sum(device["components"].values()) <= budget * MIB
    assert report["total_bytes"] == sum(sum(d["components"].values()) for d in report["devices"])
    assert report["components"] == {k: sum(per_device(report, k)) for k in report["components"]}
    # Every layer is on an RPC device (the host keeps the input embeddings), both hold some.
    layers = report["details"]["device_layers"]
    assert layers[names[0]] == 0 and layers[names[1]] > 0 and layers[names[2]] > 0
    weights, kv = per_device(report, "weights"), per_device(report, "kv")
    assert all(w > 0 for w in weights) and kv[0] == 0 and kv[1] > 0 and kv[2] > 0
    # The host holds what llama.cpp keeps there: the output buffer and the host caches.
    assert per_device(report, "output")[1:] == [0, 0] and per_device(report, "output")[0] > 0
    # The recurrent layers (and so the live state, snapshots and the device checkpoint) are
    # all on the first RPC device, which took the first layers.
    for key in ("recurrent", "snapshots", "checkpoint_reservation"):
        assert per_device(report, key)[0] == per_device(report, key)[2] == 0
        assert per_device(report, key)[1] == report["components"][key] > 0


def test_the_table_has_a_column_per_device(tiny_models: TinyModels, devices: list[str]) -> None:
    proc = specfleet("fit", "--model", str(tiny_models.dense), "--fit-target-mib", "0",
                     "--ctx-min", "256", "--spec", "ngram", "--rpc", ",".join(devices),
                     "--budget-mib", "16")
    assert proc.returncode == 0, proc.stderr
    header = proc.stdout.splitlines()[2]
    assert re.search(r"cpu MiB .* RPC0\[.*\] MiB .* RPC0\[.*\] MiB", header), proc.stdout
    assert re.search(r"layers\s+│\s+0 │\s+\d+ │\s+\d+ │ split-mode layer", proc.stdout)


def test_reversing_the_order_reverses_the_split(tiny_models: TinyModels,
                                                devices: list[str]) -> None:
    """The first device of the order takes the first layers, whichever process it is: the
    figures stay with the position, the devices swap."""
    forward = fit(tiny_models.hybrid, *HYBRID, "--rpc", ",".join(devices), "--budget-mib", "24")
    backward = fit(tiny_models.hybrid, *HYBRID, "--rpc", ",".join(reversed(devices)),
                   "--budget-mib", "24")
    names = [d["device"] for d in forward["devices"]]
    assert [d["device"] for d in backward["devices"]] == [names[0], names[2], names[1]]
    for key in ("weights", "kv", "recurrent", "snapshots", "checkpoint_reservation"):
        assert per_device(backward, key) == per_device(forward, key), key
    # So each RPC device's share changed with its place: the first layers (the recurrent
    # ones among them) went from one process to the other.
    by_name = {r: {d["device"]: d["components"] for d in r_["devices"]}
               for r, r_ in (("forward", forward), ("backward", backward))}
    assert by_name["forward"][names[1]]["recurrent"] > 0 == by_name["backward"][names[1]][
        "recurrent"]
    assert by_name["backward"][names[2]]["recurrent"] > 0 == by_name["forward"][names[2]][
        "recurrent"]
    assert by_name["forward"][names[1]]["weights"] == by_name["backward"][names[2]]["weights"]
    assert by_name["forward"][names[1]]["weights"] != by_name["backward"][names[1]]["weights"]


def test_split_mode_none_puts_everything_on_the_first_device(tiny_models: TinyModels,
                                                             devices: list[str]) -> None:
    report = fit(tiny_models.hybrid, *HYBRID, "--rpc", ",".join(devices), "--budget-mib", "24",
                 "--split-mode", "none")
    first, second = report["devices"][1]["device"], report["devices"][2]["device"]
    assert report["details"]["split_mode"] == "none"
    assert report["details"]["device_layers"][second] == 0
    assert report["details"]["device_layers"][first] > 0
    assert sum(report["devices"][2]["components"].values()) == 0
    for key in ("weights", "kv", "recurrent", "compute"):
        assert per_device(report, key)[1] > 0, key


def test_a_smaller_budget_on_one_device_shrinks_the_context(tiny_models: TinyModels,
                                                            devices: list[str]) -> None:
    group = ("--rpc", ",".join(devices), "--spec", "ngram")
    even = fit(tiny_models.dense, *group, "--budget-mib", "16")
    tight = fit(tiny_models.dense, *group, "--budget-mib", "16,13,16")
    assert tight["n_ctx"] < even["n_ctx"]
    first_rpc = tight["devices"][1]
    assert sum(first_rpc["components"].values()) <= 13 * MIB < sum(
        even["devices"][1]["components"].values())


def test_a_budget_one_device_cannot_meet_is_refused_naming_it(tiny_models: TinyModels,
                                                              devices: list[str]) -> None:
    proc = specfleet("fit", "--model", str(tiny_models.hybrid), *HYBRID, "--fit-target-mib",
                     "0", "--ctx-min", "256", "--rpc", ",".join(devices),
                     "--budget-mib", "24,24,1.5")
    assert proc.returncode == 2 and proc.stdout == ""
    line = proc.stderr.strip()
    match = re.fullmatch(
        rf"specfleet: error: context 256 \(--ctx-min 256\) does not fit on "
        rf"RPC0\[{re.escape(devices[1])}\]: needs ([\d.]+) MiB there, 1\.50 MiB available on "
        rf"RPC0\[{re.escape(devices[1])}\] \(budget: free 1\.50 MiB - margin 0\.00 MiB\): "
        rf"([\d.]+) MiB short; breakdown there: weights .*", line)
    assert match, line
    assert float(match.group(2)) == pytest.approx(float(match.group(1)) - 1.5, abs=0.011)
    lists = specfleet("fit", "--model", str(tiny_models.dense), "--rpc", ",".join(devices),
                      "--budget-mib", "8,8")
    assert lists.returncode == 2
    assert "--budget-mib has 2 values for 3 devices (cpu,RPC[" in lists.stderr
