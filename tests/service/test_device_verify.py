"""``specfleet worker --device-verify on``: the fitter measures the target with its sequences
sampled on the device (the chains given at creation), the worker serves with them, and
greedy jobs come back as a worker reading every row writes them."""

from __future__ import annotations

from coordinator.client import Coordinator
from shared.protocol import JobStatus

from .workers import CTX, MODEL_NAME, Fleet

PROMPTS = [[1 + 7 * i, 2 + 7 * i, 3, 4, 1 + 7 * i, 2 + 7 * i, 3, 4] for i in range(4)]


def _tokens(coordinator: Coordinator) -> list[list[int]]:
    handles = [coordinator.submit({"model": MODEL_NAME, "prompt_tokens": p, "max_tokens": 24,
                                   "speculative": {"method": "ngram"}}) for p in PROMPTS]
    results = [h.result(timeout=60) for h in handles]
    assert all(r.status is JobStatus.FINISHED for r in results)
    return [r.tokens for r in results]


def test_a_worker_verifying_on_the_device_serves_what_a_host_verifier_does(
        fleet: Fleet, coordinator: Coordinator) -> None:
    args = ("--ctx", str(CTX), "--slots", "2", "--spec", "ngram", "--draft-max", "4")
    fleet.start("device", args=(*args, "--device-verify", "on"))
    on_device = _tokens(coordinator)
    fleet.stop_all()
    fleet.start("host", args=(*args, "--device-verify", "off"))
    assert _tokens(coordinator) == on_device
    assert '"event": "engine.loaded"' in fleet.log("device")
