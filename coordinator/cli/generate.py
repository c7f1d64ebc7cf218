"""``specfleet generate``: run the speculative engine in-process (no Redis) on one prompt.

Operators use it to try a model and a speculation setting; acceptance checks use ``--json``.
Every failure (bad option, missing model, a method the model cannot do) exits non-zero with
one line on stderr.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer

from coordinator.cli import options as opt
from coordinator.cli.app import app, environment_settings, fail
from shared.logs import configure_logging
from shared.protocol import CheckpointMode, Telemetry
from worker.engine.engine import EngineConfig, SpeculativeEngine
from worker.engine.rollback import RollbackError
from worker.launch import EngineCapacity, parse_device_group
from worker.llm import LlamaError
from worker.llm.placement import placed


def _summary(t: Telemetry) -> str:
    """Acceptance, then what it bought, then the rates (wall time is the one to believe)."""
    return (f"{t.spec_method}: {t.accepted}/{t.drafted} drafts accepted "
            f"({100 * t.acceptance:.1f}%), {t.tokens_per_verify:.2f} tokens per verify decode "
            f"({t.target_decodes} decodes for {t.generated_tokens} tokens); "
            f"{t.tokens_per_second:.1f} tok/s decode, "
            f"{t.effective_tokens_per_second:.1f} tok/s effective{_replays(t)}")


def _replays(t: Telemetry) -> str:
    """Compact rollback's share (replays = events / tokens), when it ran."""
    if not t.checkpoint_mode:
        return ""
    return (f"; replays {t.replay_events} events / {t.replay_tokens} tokens, "
            f"{t.checkpoint_saves} {t.checkpoint_mode} checkpoints")


@app.command()
@opt.sampling_options
@opt.drafting_options("request")
def generate(
    model: opt.ModelFile,
    max_tokens: opt.MaxTokens,
    prompt: opt.Prompt = None,
    prompt_tokens: opt.PromptTokens = None,
    checkpoint: opt.Checkpoint = CheckpointMode.DEVICE,
    logprobs: opt.Logprobs = None,
    calibrate_verify: Annotated[bool, typer.Option(
        help="time verify widths at load; verify only draft lengths that pay off")] = False,
    threads: opt.Threads = opt.DEFAULT_THREADS,
    ctx: Annotated[int, typer.Option(min=2, help="context size in tokens")] = 4096,
    device: opt.Device = "cpu",
    rpc: opt.Rpc = None,
    split_mode: opt.SplitModeOption = "layer",
    tensor_split: opt.TensorSplit = None,
    as_json: opt.AsJson = False,
    *,
    sampling: dict[str, Any],
    drafting: opt.Drafting,
) -> None:
    """Generate from one prompt with the speculative engine, in this process."""
    configure_logging(level="warning")
    req = opt.build_request(prompt=prompt, prompt_tokens=prompt_tokens, max_tokens=max_tokens,
                            drafting=drafting, sampling=sampling, logprobs=logprobs)
    # Loaded for exactly what the request asks (build_request has checked N and D); the
    # request itself carries the drafter knobs, as a submitted one does.
    capacity = EngineCapacity(**drafting.capacity())
    try:
        group = parse_device_group(device, rpc, split_mode, tensor_split)
    except ValueError as exc:
        fail(str(exc))
    settings = environment_settings()
    config = EngineConfig(model_path=str(model), n_ctx=ctx, n_threads=threads, capacity=capacity,
                          checkpoint=checkpoint, calibrate_verify=calibrate_verify,
                          fail_device_checkpoint=settings.fail_device_checkpoint,
                          cost_cache=settings.cost_cache(),
                          n_gpu_layers=-1 if group.offload else 0)
    try:
        with placed(group), SpeculativeEngine(config) as engine:
            tokens = req.prompt_tokens or engine.tokenize(req.prompt or "")
            result = engine.generate(tokens, req.max_tokens, req.speculative,
                                     sampling=req.sampling, logprobs=req.logprobs_k)
    except (ValueError, LlamaError, RollbackError, NotImplementedError) as exc:
        fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    if as_json:
        out: dict[str, Any] = {"tokens": result.tokens, "text": result.text,
                               "seed": result.seed,
                               "telemetry": result.telemetry.model_dump(mode="json")}
        if req.logprobs:
            out["logprobs"] = [lp.model_dump(mode="json") for lp in result.logprobs]
        print(json.dumps(out))
    else:
        print(result.text)
        sys.stderr.write(_summary(result.telemetry) + "\n")
        sys.stderr.write(opt.sampling_line(req.sampling, result.seed) + "\n")
