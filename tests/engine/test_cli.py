"""``specfleet generate`` as operators and acceptance checks run it: a real subprocess."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import N_CTX, specfleet

from .conftest import PROMPT, Subject

PROMPT_ARG = ",".join(map(str, PROMPT))


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return specfleet("generate", *args, "--threads", "1", "--ctx", str(N_CTX))


def test_json_output_matches_the_engine(hybrid_model: Path, hybrid_mtp: Subject) -> None:
    proc = run("--model", str(hybrid_model), "--prompt-tokens", PROMPT_ARG, "--max-tokens", "60",
               "--spec", "mtp", "--draft-max", "3", "--adaptive", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) == {"tokens", "text", "seed", "telemetry"}
    assert out["tokens"] == hybrid_mtp.reference[:60]
    assert out["text"] == hybrid_mtp.engine.detokenize(out["tokens"])
    telemetry = out["telemetry"]
    assert telemetry["spec_method"] == "mtp"
    assert telemetry["generated_tokens"] == 60
    assert 0 < telemetry["accepted"] <= telemetry["drafted"]
    assert sum(telemetry["accepted_per_position"]) == telemetry["accepted"]


def test_plain_output_is_text_with_a_summary_on_stderr(dense_model: Path) -> None:
    proc = run("--model", str(dense_model), "--prompt-tokens", PROMPT_ARG, "--max-tokens", "20",
               "--spec", "ngram")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert "tokens per verify decode" in proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--spec", "mtp"], "no MTP (NextN) head"),
    (["--draft-max", "2", "--draft-min", "3"], "draft_min"),
    (["--draft-max", "2", "--rollback-depth", "3"], "rollback_depth"),
    (["--temperature", "2.5", "--top-p", "0"],
     "--temperature: Input should be less than or equal to 2; --top-p: Input should be "
     "greater than 0"),
    (["--logprobs", "21"], "'--logprobs'"),
])
def test_errors_exit_non_zero_with_one_line(headless_model: Path, args: list[str],
                                            message: str) -> None:
    proc = run("--model", str(headless_model), "--prompt-tokens", PROMPT_ARG, "--max-tokens", "5",
               *args)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_sampling_with_the_default_spec_repeats_by_seed_and_returns_logprobs(
        dense_model: Path) -> None:
    """``--temperature`` works with ``--spec auto``; the seed is reported (human line and
    ``--json``) and the same seed gives the same tokens; ``--logprobs N`` gives one entry a
    token with N alternatives."""
    args = ("--model", str(dense_model), "--prompt-tokens", PROMPT_ARG, "--max-tokens", "12",
            "--temperature", "0.9", "--top-p", "0.95", "--seed", "11")
    first = run(*args, "--logprobs", "2", "--json")
    assert first.returncode == 0, first.stderr
    out = json.loads(first.stdout)
    assert out["seed"] == 11 and out["telemetry"]["spec_method"] == "suffix"
    assert [lp["token"] for lp in out["logprobs"]] == out["tokens"]
    assert all(len(lp["top_logprobs"]) == 2 and lp["logprob"] <= 0 for lp in out["logprobs"])
    human = run(*args)
    assert human.returncode == 0, human.stderr
    assert human.stdout == out["text"] + "\n"
    assert "sampling: temperature 0.9, top-p 0.95; seed 11 (--seed 11 repeats it)" in human.stderr


def test_missing_model_is_a_one_line_error(tmp_path: Path) -> None:
    proc = run("--model", str(tmp_path / "nope.gguf"), "--prompt", "hi", "--max-tokens", "5")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [f"specfleet: error: model file not found: "
                                                f"{tmp_path / 'nope.gguf'}"]
