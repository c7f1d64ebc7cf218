"""The Node clients' two-turn tool loops against a live fleet: the Node ``openai`` SDK (chat
completions and the Responses API, each whole and through its stream helpers) and the Vercel
AI SDK (``generateText`` and ``streamText`` on the provider's default model, which is the
Responses API, and on its chat model). The scripts and their pinned packages are in
``tests/node`` (package.json, package-lock.json); ``npm ci`` installs them on first use.

Each loop's first turn must call the tool (``tool_choice`` required), the client runs it and
sends the call and its result back, and the second turn must answer in text (``tool_choice``
none, the tools still offered). The worker is the byte-level tiny model with random weights
(``byte_fleet``): the call's name and arguments are the constraint's work, the text is noise.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from .conftest import Deployment, queued

from service.workers import MODEL_NAME  # isort: skip

CLIENTS = Path(__file__).resolve().parents[1] / "node"
ASK = "What is the weather like in Paris?"  # tests/node/common.mjs asks it
#: Each script's finish reasons: a turn that called tools, and a turn that answered in text
#: (``length`` where the random model's text runs out of budget first).
FINISHES: dict[str, tuple[set[str], set[str]]] = {
    "openai_sdk.mjs chat": ({"tool_calls"}, {"stop", "length"}),
    "openai_sdk.mjs responses": ({"completed"}, {"completed", "incomplete"}),
    "ai_sdk.mjs chat": ({"tool-calls"}, {"stop", "length"}),
    "ai_sdk.mjs responses": ({"tool-calls"}, {"stop", "length"}),
}


@pytest.fixture(scope="session")
def node() -> str:
    """The ``node`` binary, with tests/node's packages installed as its lockfile pins them:
    ``npm ci`` when ``node_modules`` is missing or was installed from another lockfile.
    Skips where node or npm is not installed (.ci/run installs them)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node and npm are not installed (apt-get install nodejs npm; "
                    ".ci/run installs them)")
    lock = hashlib.sha256((CLIENTS / "package-lock.json").read_bytes()).hexdigest()
    stamp = CLIENTS / "node_modules" / ".specfleet-lock-sha256"
    if not stamp.is_file() or stamp.read_text() != lock:
        done = subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=CLIENTS,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"npm ci in {CLIENTS} failed:\n{done.stderr[-4000:]}"
        stamp.write_text(lock)
    return node


def _job(reply_id: str) -> str:
    """The gateway job behind a completion's or a response's id."""
    return reply_id.removeprefix("chatcmpl-").removeprefix("resp_")


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("client", list(FINISHES))
def test_a_node_client_runs_a_two_turn_tool_loop(node: str, byte_fleet: Deployment,
                                                 client: str, streamed: bool) -> None:
    """The tool runs once with the arguments of the one call; the second turn's queued
    messages are the question, that call (its id, name and arguments) and the tool's
    result answering it; the second turn answers in text, its finish reason the API's."""
    script, mode = client.split()
    run = subprocess.run(
        [node, script, mode + ("-stream" if streamed else ""), byte_fleet.gateway.url + "/v1",
         MODEL_NAME], cwd=CLIENTS, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-4000:]
    summary: dict[str, Any] = json.loads(run.stdout)
    first, second = summary["turns"]
    [call] = first["calls"]
    arguments = json.loads(call["arguments"])
    assert call["name"] == "get_weather" and arguments["city"] in ("Paris", "Oslo"), call
    assert summary["ran"] == [arguments]
    assert second["calls"] == [] and second["text"], second
    called, answered = FINISHES[client]
    assert first["finish"] in called and second["finish"] in answered, summary["turns"]

    asked = queued(byte_fleet, _job(first["id"]))
    assert asked["messages"] == [{"role": "user", "content": ASK}] and "constraint" in asked
    answer = queued(byte_fleet, _job(second["id"]))
    assert answer["messages"] == [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": call["id"], "type": "function",
            "function": {"name": "get_weather", "arguments": call["arguments"]}}]},
        {"role": "tool", "content": f"18 C in {arguments['city']}", "tool_call_id": call["id"]}]
    assert "constraint" not in answer
