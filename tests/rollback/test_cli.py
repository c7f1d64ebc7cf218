"""``specfleet generate --rollback-depth D --checkpoint MODE`` reaches compact rollback."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import N_CTX, PROMPT, specfleet

from .conftest import MATRIX_TOKENS


def generate_json(model: Path, checkpoint: str, **env: str) -> dict[str, object]:
    proc = specfleet(
        "generate", "--model", str(model),
        "--prompt-tokens", ",".join(map(str, PROMPT)), "--max-tokens", str(MATRIX_TOKENS),
        "--spec", "mtp", "--draft-max", "5",
        "--rollback-depth", "1", "--checkpoint", checkpoint, "--threads", "1",
        "--ctx", str(N_CTX), "--json", env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize(("checkpoint", "env", "mode", "fallbacks"), [
    ("host", {}, "host", 0),
    ("device", {"SPECFLEET_FAIL_DEVICE_CHECKPOINT": "1"}, "host", 1),
], ids=["forced-host", "device-fault-injected"])
def test_cli_options_reach_compact_rollback(hybrid_model: Path, hybrid_reference: list[int],
                                            checkpoint: str, env: dict[str, str], mode: str,
                                            fallbacks: int) -> None:
    out = generate_json(hybrid_model, checkpoint, **env)
    telemetry = out["telemetry"]
    assert out["tokens"] == hybrid_reference[:MATRIX_TOKENS]
    assert telemetry["rollback_depth"] == 1
    assert telemetry["checkpoint_mode"] == mode
    assert telemetry["host_fallbacks"] == fallbacks
    assert telemetry["checkpoint_saves"] > 0
    assert telemetry["replay_events"] > 0
