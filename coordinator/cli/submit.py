"""``specfleet submit``: queue one request on the fleet, optionally stream it, print the result."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer
from redis import RedisError

from coordinator.cli.app import app, fail
from coordinator.cli.options import parse_tokens as _parse_tokens
from coordinator.client import Coordinator, JobResult
from coordinator.validation import SubmitError
from shared.logs import configure_logging
from shared.protocol import JobStatus, Priority, SpecMethod
from shared.settings import get_settings


def print_result(result: JobResult, as_json: bool, streamed: bool) -> None:
    """The final object (``--json``) or the text; a failed or cancelled job exits non-zero."""
    if as_json:
        print(json.dumps(result.to_json()))
    elif not streamed:
        print(result.text)
    if result.status is not JobStatus.FINISHED:
        fail(f"job {result.job_id} {result.status}: {result.error or result.finish_reason}",
             code=1)


@app.command()
def submit(
    model: Annotated[str, typer.Option(help="served model name")],
    max_tokens: Annotated[int, typer.Option(help="tokens to generate at most")],
    prompt: Annotated[str | None, typer.Option(help="prompt text")] = None,
    prompt_tokens: Annotated[str | None, typer.Option(help="prompt token ids: 1,2,3")] = None,
    spec: Annotated[SpecMethod, typer.Option(help="drafting method")] = SpecMethod.AUTO,
    draft_max: Annotated[int, typer.Option(help="draft width ceiling N")] = 8,
    draft_min: Annotated[int, typer.Option(help="shorter drafts are dropped")] = 0,
    p_min: Annotated[float, typer.Option(help="stop drafting below this confidence")] = 0.0,
    adaptive: Annotated[bool, typer.Option(help="adapt the draft width (seed 003 rule)")] = False,
    rollback_depth: Annotated[int | None, typer.Option(help="direct rollback depth D")] = None,
    temperature: Annotated[float, typer.Option(help="sampling temperature (needs --spec none)")]
    = 0.0,
    seed: Annotated[int, typer.Option(help="sampling seed")] = 0,
    stop: Annotated[list[str] | None, typer.Option(help="stop sequence (repeatable)")] = None,
    priority: Annotated[Priority, typer.Option(help="queue priority")] = Priority.NORMAL,
    stream: Annotated[bool, typer.Option(help="print text as it is generated")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print one final JSON object")] = False,
    timeout: Annotated[float | None, typer.Option(help="seconds to wait for the result")] = None,
) -> None:
    """Submit one generation to the fleet and wait for its result."""
    settings = get_settings()
    configure_logging(settings.log_level, settings.log_format)
    if (prompt is None) == (prompt_tokens is None):
        fail("give exactly one of --prompt or --prompt-tokens")
    request: dict[str, Any] = {
        "model": model, "max_tokens": max_tokens, "temperature": temperature, "seed": seed,
        "stop": stop or [], "priority": priority.value,
        "speculative": {"method": spec.value, "draft_max": draft_max, "draft_min": draft_min,
                        "p_min": p_min, "adaptive": adaptive, "rollback_depth": rollback_depth},
    }
    if prompt is not None:
        request["prompt"] = prompt
    else:
        request["prompt_tokens"] = _parse_tokens(prompt_tokens or "")
    try:
        handle = Coordinator(settings).submit(request)
        if stream:
            out = sys.stderr if as_json else sys.stdout
            for delta in handle.text_stream(timeout):
                out.write(delta)
                out.flush()
            out.write("\n")
        result = handle.result(timeout)
    except SubmitError as exc:
        fail(str(exc))
    except TimeoutError as exc:
        fail(str(exc), code=1)
    except RedisError as exc:
        fail(f"Redis at {settings.redis_url}: {exc}", code=3)
    print_result(result, as_json, streamed=stream)
