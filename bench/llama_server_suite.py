"""llama.cpp's own server tests (``tools/server/tests/unit``), the OpenAI-shaped ones, run
against a live specfleet fleet, with the failures sorted by class so protocol regressions show.

Needs the llama.cpp sources, so it is a dev-time check, not part of ``make test``. They ship in
the llama-cpp-python sdist the worker pins::

    .venv/bin/pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d /tmp/sdist
    tar xzf /tmp/sdist/llama_cpp_python-0.3.36.tar.gz -C /tmp/sdist
    .venv/bin/python bench/llama_server_suite.py \\
        --tests /tmp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp/tools/server/tests

It starts one worker (the project's tiny chat GGUF unless ``--model``) and one gateway under a
fresh key prefix of the Redis at ``REDIS_URL`` (default 127.0.0.1:6379), runs the suite in
llama.cpp's "external server" mode, and prints each class's count and the protocol failures.
The suite is written for llama-server, so its harness is adapted, never its tests: paths go
to ``/v1`` (llama-server also serves OpenAI's API without the prefix), a missing or null
``model`` names the served model (llama-server ignores it; OpenAI requires it), and the model
names the tests send are model aliases of the served one.

Classes: ``protocol`` (an incompatibility of ours: must be 0), ``unsupported`` (an OpenAI
feature refused by name: image input), ``llama-server-only`` (its own endpoints and fields:
``/completion``, ``/slots``, ``n_probs``, ``timings``, its embedding inputs, ...),
``model-text`` (the tests' expected text, token ids and counts of llama.cpp's 260K stories
model). The worker serves ``/v1/embeddings`` (``--embeddings``), so the embedding and
tokenize modules run too.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
SPECFLEET = str(ROOT / ".venv" / "bin" / "specfleet")
#: The served name: the suite's preset model alias, which its model listing tests expect.
MODEL_NAME = "tinyllama-2"
#: The suite's OpenAI-shaped test modules.
FILES = ("test_chat_completion.py", "test_completion.py", "test_compat_oai_responses.py",
         "test_basic.py", "test_security.py", "test_stream.py", "test_embedding.py",
         "test_tokenize.py")
#: The worker's embedding context (``--embeddings``): the suite's longest input is ~260 tokens.
EMBEDDING_TOKENS = 512

#: llama-server's own endpoints (a request to one, printed by the harness) ...
LLAMA_ENDPOINTS = re.compile(r"^suite-request \w+ /(completion|props|"
                             r"slots|infill|apply-template|embedding|rerank|v1/stream|"
                             r"chat/completions/input_tokens)\b", re.M)
#: ... and its own fields, sent (and refused by us as unknown) or read from an answer.
LLAMA_FIELDS = re.compile("|".join(re.escape(s) for s in (
    "n_probs", "cache_prompt", "timings", "tokens_predicted", "tokens_evaluated", "id_slot",
    "return_tokens", "n_predict", "reasoning_content", "chat_template_kwargs",
    "post_sampling_probs", "prompt_progress", "completion_probabilities", "ignore_eos",
    "n_indent", "grammar", "json_schema", "samplers", "typical_p", "mirostat", "dry_", "xtc_",
    "top_n_sigma", "return_progress", "lora", "n_cmpl", "t_max_predict_ms", "__verbose",
    "continue_final_message", "add_generation_prompt", "KeyError: 'content'",
    "KeyError: 'aliases'", "startswith('b')", "assert 'content' in")))
#: Tests of llama-server's own behaviour that a failure message cannot show, and why.
KNOWN: dict[str, tuple[str, str]] = {
    "test_invalid_chat_completion_req[messages7]": (
        "llama-server-only", "it refuses two assistant turns in a row; OpenAI accepts them"),
    "test_context_size_exceeded": (
        "llama-server-only", "its own error type exceed_context_size_error and n_ctx fields "
        "(ours: OpenAI's invalid_request_error, code context_length_exceeded)"),
    "test_context_size_exceeded_stream": (
        "llama-server-only", "exceed_context_size_error, n_prompt_tokens, n_ctx"),
    "test_server_model_aliases_and_tags": (
        "llama-server-only", "model tags and an id taken from the first alias"),
    "test_no_ui": ("llama-server-only", "its web UI at /"),
    "test_cors_origins_localhost": (
        "llama-server-only", "its localhost-only default origins when tools are enabled"),
    "test_cors_origins_defaults_to_localhost": (
        "llama-server-only", "its localhost-only default origins when tools are enabled"),
    "test_stream_stop_during_model_load": ("llama-server-only", "router mode: model loads"),
    "test_stream_resumes_after_reload": ("llama-server-only", "router mode: model loads"),
    "test_stream_resume_and_stop": ("llama-server-only", "its /v1/stream resume endpoint"),
    "test_local_media_file": ("unsupported", "image input (file:// media)"),
    "test_cors_options": (
        "llama-server-only", "its header values (credentials, methods), read case-sensitively "
        "(uvicorn sends header names lower-case, as HTTP allows)"),
    "test_incorrect_api_key": ("llama-server-only", "a server started with a key per test"),
    "test_openai_library_correct_api_key": (
        "llama-server-only", "a key per test, and OpenAI paths without /v1 (OpenAI's own API "
        "has none either)"),
    "test_access_static_assets": ("llama-server-only", "its web UI assets"),
    "test_server_multiple_addresses": ("llama-server-only", "its --host list"),
    "test_load_split_model": ("llama-server-only", "a split GGUF downloaded per test"),
    "test_verbose_debug": ("llama-server-only", "its 'verbose' field (refused: unknown)"),
    "test_cors_proxy": ("llama-server-only", "its CORS proxy endpoint"),
    "test_chat_completion_stream": (
        "llama-server-only", "its opening chunk's content is null; OpenAI's (and ours) is ''"),
    "test_logprobs_stream": (
        "llama-server-only", "its opening chunk's content is null; OpenAI's (and ours) is ''"),
    "test_chat_completion_with_openai_library": (
        "llama-server-only", "its build number as system_fingerprint ('b...')"),
    "test_completion_with_openai_library": (
        "llama-server-only", "its build number as system_fingerprint ('b...')"),
    "test_completion_with_response_format[response_format0": (
        "llama-server-only", "its response_format json_object with a 'schema' (OpenAI's is "
        "json_schema)"),
    "test_completion_with_response_format[response_format1": (
        "llama-server-only", "its response_format json_object with a 'schema' (OpenAI's is "
        "json_schema)"),
    "test_completion_with_response_format[response_format3": (
        "model-text", "json_object on the tiny test vocabulary, which spells no '{'"),
    "test_embedding_mixed_input[-False]": (
        "llama-server-only", "it embeds an empty string; OpenAI refuses one"),
    "test_embedding_mixed_input[input3": (
        "llama-server-only", "text and token ids mixed in one input"),
    "test_embedding_mixed_input[input5": (
        "llama-server-only", "text and token-id inputs mixed in one list (OpenAI: one kind)"),
    "test_embedding_mixed_input[input7": (
        "llama-server-only", "text and token ids mixed in one input"),
    "test_embedding_mixed_input[input8": (
        "llama-server-only", "its multimodal prompt objects as inputs"),
    "test_embedding_mixed_input[input9": (
        "llama-server-only", "its multimodal prompt objects as inputs"),
    "test_embedding_mixed_input[input10": (
        "llama-server-only", "its multimodal prompt objects as inputs"),
    "test_embedding_content_text_same_as_string": (
        "llama-server-only", "its multimodal prompt objects as inputs"),
    "test_embedding_pooling_none": (
        "llama-server-only", "its --pooling none: a vector per token, or a 400 on /v1"),
    "test_tokenize_with_bos": (
        "model-text", "the stories model's BOS (id 1); the tiny model adds none"),
}
#: Our refusals of OpenAI features named in the issue as not supported yet.
UNSUPPORTED = re.compile(r"tool and function calling|structured outputs|only text output")
#: An assertion about the model's text or its token counts.
MODEL_TEXT = re.compile(r"match_regex|re_content|n_predicted|n_prompt|prompt_tokens|"
                        r"completion_tokens|assert .*content|\.startswith|Sarax|Suddenly")

CONFTEST = '''
import json, os, sys, types
sys.modules.setdefault("wget", types.ModuleType("wget"))  # downloads: none in external mode
import pytest
import utils

SERVED = os.environ["SUITE_MODEL"]
_url = utils.ServerProcess.make_url


def make_url(self, path, host=None):
    if not path.startswith("/v1/") and path.split("?")[0] in (
            "/chat/completions", "/completions", "/models", "/responses", "/embeddings"):
        path = "/v1" + path
    return _url(self, path, host)


def _fill(method, path, data):
    """The request as sent, printed for the classifier (its path and fields)."""
    fields = sorted(data) if isinstance(data, dict) else []
    print(f"suite-request {method} {path.split('?')[0]} fields={','.join(fields)}")
    if isinstance(data, dict) and data.get("model") is None:
        data = {**data, "model": SERVED}
    return data


_request, _stream = utils.ServerProcess.make_request, utils.ServerProcess.make_stream_request
utils.ServerProcess.make_url = make_url
utils.ServerProcess.make_request = lambda self, m, p, data=None, *a, **k: _request(
    self, m, p, _fill(m, p, data), *a, **k)
utils.ServerProcess.make_stream_request = lambda self, m, p, data=None, *a, **k: _stream(
    self, m, p, _fill(m, p, data), *a, **k)


@pytest.fixture(autouse=True)
def stop_server_after_each_test():
    yield
'''


def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _aliases(tests: Path) -> list[str]:
    """The model names the suite sends, to be aliases of the served model."""
    names = set()
    for path in (tests / "unit").glob("*.py"):
        names |= set(re.findall(r'"model":\s*"([\w.:/\-]+)"', path.read_text()))
        names |= set(re.findall(r'model="([\w.:/\-]+)"', path.read_text()))
        names |= set(re.findall(r'^MODEL\s*=\s*"([\w.:/\-]+)"', path.read_text(), re.M))
    names |= {"gpt-3.5-turbo", "gpt-4", "codellama70b"}
    return sorted(n for n in names if n != MODEL_NAME)


def classify(name: str, failure: str, printed: str) -> str:
    """The class of one failure, from its test's name, its message and ``E`` lines, and what
    it printed (each request's path and fields, the server's answers)."""
    for prefix, (kind, _) in KNOWN.items():
        if name.partition("::")[2].startswith(prefix):
            return kind
    text = f"{failure}\n{printed}"
    if UNSUPPORTED.search(text):
        return "unsupported"
    if LLAMA_ENDPOINTS.search(printed) or LLAMA_FIELDS.search(text):
        return "llama-server-only"
    if MODEL_TEXT.search(failure):
        return "model-text"
    return "protocol"


def _start(args: argparse.Namespace, logs: Path, env: dict[str, str],
           port: int) -> list[subprocess.Popen[bytes]]:
    model = args.model
    if model is None:
        from worker.testmodels.tiny import write_dense_llama
        model = write_dense_llama(logs / "tiny-chat.gguf", chat=True)
    worker = subprocess.Popen([SPECFLEET, "worker", "--model", str(model), "--model-name",
                               MODEL_NAME, "--name", "suite", "--threads", "1", "--ctx",
                               str(args.ctx), "--slots", "2", "--embeddings",
                               str(EMBEDDING_TOKENS)], env=env,
                              stdout=(logs / "worker.log").open("wb"), stderr=subprocess.STDOUT)
    alias_args = [a for name in _aliases(args.tests) for a in ("--model-alias",
                                                                f"{name}={MODEL_NAME}")]
    # llama-server answers CORS from any origin by default; so does the gateway here
    gateway = subprocess.Popen([SPECFLEET, "serve", "--port", str(port), "--cors-origins", "*",
                                *alias_args], env=env,
                               stdout=(logs / "gateway.log").open("wb"),
                               stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).json()
            if health.get("models", {}).get(MODEL_NAME):
                return [worker, gateway]
        except (httpx.TransportError, ValueError):
            pass
        for proc in (worker, gateway):
            if proc.poll() is not None:
                sys.exit(f"a fleet process exited; logs in {logs}")
        time.sleep(0.2)
    sys.exit(f"the fleet did not come up; logs in {logs}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", type=Path, required=True,
                        help="llama.cpp's tools/server/tests directory")
    parser.add_argument("--model", type=Path, default=None, help="GGUF to serve "
                        "(default: the project's tiny chat model)")
    parser.add_argument("--ctx", type=int, default=512, help="the worker's context")
    parser.add_argument("--files", default=",".join(FILES), help="test modules to run")
    parser.add_argument("--verbose", action="store_true", help="print every failure's class")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="llama-suite-"))
    shutil.copytree(args.tests / "unit", work / "unit")
    shutil.copy(args.tests / "utils.py", work / "utils.py")
    (work / "conftest.py").write_text(CONFTEST)
    port = _free_port()
    env = {**os.environ, "SPECFLEET_PREFIX": f"suite{uuid.uuid4().hex[:8]}",
           "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "")}
    procs = _start(args, work, env, port)
    try:
        report = work / "report.xml"
        files = [f"unit/{name}" for name in args.files.split(",") if name]
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "--rootdir", str(work), "-c", os.devnull, f"--junitxml={report}",
                        "-o", "junit_logging=system-out",
                        "-o", "addopts=", *files],
                       cwd=work, env={**env, "DEBUG_EXTERNAL": "1", "PORT": str(port),
                                      "SUITE_MODEL": MODEL_NAME},
                       stdout=(work / "pytest.log").open("wb"), stderr=subprocess.STDOUT,
                       check=False)
        _summarise(report, args.verbose)
        print(f"(logs and the report: {work})")
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)


def _summarise(report: Path, verbose: bool) -> None:
    classes: Counter[str] = Counter()
    protocol: list[str] = []
    for case in ET.parse(report).iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if case.find("skipped") is not None:
            classes["skipped"] += 1
            continue
        if problem is None:
            classes["passed"] += 1
            continue
        lines = [line for line in (problem.text or "").splitlines()
                 if line.startswith(("E ", ">"))]
        out = case.find("system-out")
        kind = classify(name, "\n".join([problem.get("message", ""), *lines]),
                        out.text or "" if out is not None else "")
        classes[kind] += 1
        line = f"  {kind:18} {name}: {problem.get('message', '')[:160]}"
        if kind == "protocol":
            protocol.append(line)
        elif verbose:
            print(line)
    total = sum(classes.values())
    print(f"{total} tests: " + ", ".join(f"{k} {v}" for k, v in sorted(classes.items())))
    if protocol:
        print("protocol failures:")
        print("\n".join(protocol))


if __name__ == "__main__":
    main()
