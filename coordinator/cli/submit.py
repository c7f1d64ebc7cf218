"""``specfleet submit``: queue one request on the fleet, optionally stream it, print the result.

``--json-schema FILE`` (a JSON Schema, its objects closed as over HTTP:
``openai_api.structured.closed``) or ``--grammar FILE`` (Lark, or GBNF or a regex with
``--grammar-syntax``) constrains the output; either is compiled before anything is queued,
and one that does not compile exits 2 naming its option and the problem.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from pydantic import ValidationError
from redis import RedisError

from coordinator.cli import options as opt
from coordinator.cli.app import app, environment_settings, fail, fail_redis
from coordinator.client import Coordinator
from coordinator.openai_api.structured import closed
from coordinator.validation import SubmitError
from shared.constraint import Constraint, ConstraintError, ConstraintKind, check_constraint
from shared.logs import configure_logging
from shared.outage import RedisOutage
from shared.protocol import JobStatus, Priority, SamplingParams, describe_validation_error
from shared.results import JobResult

GrammarSyntax = Literal["lark", "gbnf", "regex"]


def read_constraint(json_schema: Path | None, grammar: Path | None,
                    grammar_syntax: GrammarSyntax) -> Constraint | None:
    """The constraint the options ask for, compiled, or an exit naming the option at fault."""
    if json_schema is not None and grammar is not None:
        fail("--json-schema and --grammar both constrain the output: give one")
    option, path = ("--json-schema", json_schema) if json_schema is not None else (
        "--grammar", grammar)
    if path is None:
        return None
    try:
        text = path.read_text(encoding="utf-8")
        fields: dict[str, Any] = (
            {"kind": ConstraintKind.JSON_SCHEMA, "json_schema": closed(json.loads(text))}
            if json_schema is not None else
            {"kind": ConstraintKind(grammar_syntax), "grammar": text})
        constraint = Constraint(**fields)
        check_constraint(constraint)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, ConstraintError) as exc:
        fail(f"{option} {path}: {exc}")
    except ValidationError as exc:
        fail(f"{option} {path}: {describe_validation_error(exc, subject=None)}")
    return constraint


def print_result(result: JobResult, as_json: bool, streamed: bool,
                 sampling: SamplingParams | None = None) -> None:
    """The final object (``--json``) or the text, and on stderr what it sampled with and
    its seed; a failed or cancelled job exits non-zero."""
    if as_json:
        print(json.dumps(result.to_json()))
    elif not streamed:
        print(result.text)
    if not as_json and sampling is not None and result.seed is not None:
        sys.stderr.write(opt.sampling_line(sampling, result.seed) + "\n")
    if result.status is not JobStatus.FINISHED:
        fail(f"job {result.job_id} {result.status}: {result.error or result.finish_reason}",
             code=1)


@app.command()
@opt.sampling_options
@opt.drafting_options("fleet")
def submit(
    model: Annotated[str, typer.Option(help="served model name")],
    max_tokens: opt.MaxTokens,
    prompt: opt.Prompt = None,
    prompt_tokens: opt.PromptTokens = None,
    logprobs: opt.Logprobs = None,
    stop: Annotated[list[str] | None, typer.Option(help="stop sequence (repeatable)")] = None,
    priority: Annotated[Priority, typer.Option(help="queue priority")] = Priority.NORMAL,
    stream: Annotated[bool, typer.Option(help="print text as it is generated")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print one final JSON object")] = False,
    timeout: Annotated[float | None, typer.Option(help="seconds to wait for the result")] = None,
    json_schema: Annotated[Path | None, typer.Option(
        help="constrain the output to JSON valid under the JSON Schema in FILE",
        metavar="FILE")] = None,
    grammar: Annotated[Path | None, typer.Option(
        help="constrain the output to the grammar in FILE (--grammar-syntax)",
        metavar="FILE")] = None,
    grammar_syntax: Annotated[GrammarSyntax, typer.Option(
        help="the syntax of --grammar: lark (llguidance's), gbnf (llama.cpp's) or regex")
    ] = "lark",
    *,
    sampling: dict[str, Any],
    drafting: opt.Drafting,
) -> None:
    """Submit one generation to the fleet and wait for its result."""
    settings = environment_settings()
    configure_logging(settings.log_level, settings.log_format)
    request = opt.build_request(prompt=prompt, prompt_tokens=prompt_tokens,
                                max_tokens=max_tokens, drafting=drafting, sampling=sampling,
                                logprobs=logprobs, model=model, stop=stop or (),
                                priority=priority)
    constraint = read_constraint(json_schema, grammar, grammar_syntax)
    if constraint is not None:
        request = request.model_copy(update={"constraint": constraint})
    try:
        # a model that is coming (declared, a worker loading) is waited for, as over HTTP
        handle = Coordinator(settings).submit(request,
                                              wait_seconds=settings.wait_for_worker_seconds)
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
    except (RedisError, RedisOutage) as exc:  # past redis_outage_seconds, or no retry mends
        fail_redis(settings, exc)
    print_result(result, as_json, streamed=stream, sampling=request.sampling)
