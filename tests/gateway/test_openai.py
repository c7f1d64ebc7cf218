"""Completions and chat through a live gateway and real workers, with the real openai client."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
from helpers import close_floats

from coordinator.client import Coordinator
from shared.protocol import MAX_DRAFT, GenerationRequest, JobStatus
from shared.settings import Settings
from worker.engine.prompt import build_prompt
from worker.llm.model import Model, ModelSpec

from .conftest import Deployment
from .gateway import Gateway

from service.workers import MODEL_NAME, Fleet  # isort: skip

PROMPT = [5, 17, 33, 2]


def test_completion_is_the_fleets_own_result(deployment: Deployment) -> None:
    """OpenAI's default temperature (1) samples; the seed drawn for the job is reported
    under ``specfleet`` and gives the same tokens to a direct request."""
    client, settings = deployment.client(), deployment.settings
    reply = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12)
    seed = reply.specfleet["seed"]
    assert isinstance(seed, int)
    direct = Coordinator(settings).submit(
        {"model": MODEL_NAME, "prompt_tokens": PROMPT, "max_tokens": 12,
         "sampling": {"temperature": 1.0, "seed": seed}}).result(timeout=30)
    assert reply.choices[0].text == direct.text and direct.seed == seed
    greedy = Coordinator(settings).submit(
        {"model": MODEL_NAME, "prompt_tokens": PROMPT, "max_tokens": 12}).result(timeout=30)
    assert client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12,
                                     temperature=0).choices[0].text == greedy.text
    assert reply.choices[0].finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (4, 12)
    job_id = reply.specfleet["job_id"]
    assert reply.id == f"cmpl-{job_id}"
    assert reply.specfleet["telemetry"]["generated_tokens"] == 12


def test_chat_streamed_and_not_tell_the_same_story(deployment: Deployment,
                                                   chat_model: Path) -> None:
    client = deployment.client()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                           max_completion_tokens=10, seed=3)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                            max_tokens=10, seed=3, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and text
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == "length" and set(finish[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    # the prompt is the model's chat template rendered by the worker
    with Model(ModelSpec(str(chat_model))) as model:
        rendered = build_prompt(model, GenerationRequest(model=MODEL_NAME, messages=messages))
    assert whole.usage.prompt_tokens == chunks[-1].usage.prompt_tokens == len(rendered)


def test_logprobs_streamed_and_not_are_the_same_numbers(deployment: Deployment) -> None:
    """Chat: OpenAI's ``logprobs.content`` with ``top_logprobs`` alternatives, the same in a
    stream's chunks as in the whole reply (same seed: same tokens); completions: the legacy
    shape. Sampling with speculation (the default ``auto``) is no longer refused."""
    client = deployment.client()
    ask = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
               temperature=0.8, top_p=0.95, seed=5, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**ask)  # type: ignore[call-overload]
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 8
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert all(bytes(t.bytes or []).decode(errors="replace") == t.token for t in content)
    assert whole.specfleet["seed"] == 5
    # The stream is compared with a whole reply that decoded the same batches: a repeat that
    # reuses the prefix or drafts the cached answer verifies wider rows, whose logits differ
    # in the last bits, and two alternatives tied that closely (18.4 nats down on this model)
    # then swap places. Plain sampling with the same seed draws the same tokens as above.
    same = dict(ask, extra_body={"specfleet": {"speculative": {"method": "none"},
                                               "prefix_cache": False}})
    plain = client.chat.completions.create(**same).choices[0].logprobs.content  # type: ignore[call-overload]
    assert [t.token for t in plain] == [t.token for t in content]
    chunks = list(client.chat.completions.create(**same, stream=True))  # type: ignore[call-overload]
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    assert close_floats(streamed) == close_floats(plain)
    legacy = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6,
                                       temperature=0.8, seed=5, logprobs=2)
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 6
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0


def test_refusals_are_openai_errors_with_the_right_status(deployment: Deployment) -> None:
    client = deployment.client()
    with pytest.raises(openai.NotFoundError) as unknown:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert "unknown model 'nope'" in unknown.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL_NAME, reasoning_effort="low",
                                       messages=[{"role": "user", "content": "x"}])
    assert bad.value.body["param"] == "reasoning_effort" and "reasoning" in bad.value.message
    with pytest.raises(openai.BadRequestError) as unknown_field:
        client.chat.completions.create(model=MODEL_NAME, extra_body={"guided_json": {}},
                                       messages=[{"role": "user", "content": "x"}])
    assert unknown_field.value.body["param"] == "guided_json"
    with pytest.raises(openai.BadRequestError) as strict:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=True)  # type: ignore[arg-type]
    assert strict.value.body["param"] == "max_tokens"
    # The protocol's draft-width cap, then a width within it that no live worker was loaded
    # for: both refused by name, neither clamped.
    for width, said in ((MAX_DRAFT + 1, "draft_max"), (MAX_DRAFT, "exceeds the worker's")):
        with pytest.raises(openai.BadRequestError) as wide:
            client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, extra_body={
                "specfleet": {"speculative": {"draft_max": width}}})
        assert said in wide.value.message


def test_no_live_worker_is_503(settings: Settings, client: openai.OpenAI) -> None:
    Coordinator(settings).connection.sadd(settings.keys.models(), MODEL_NAME)
    with pytest.raises(openai.InternalServerError) as unavailable:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2)
    assert unavailable.value.status_code == 503
    assert unavailable.value.body["code"] == "no_live_worker"


def test_special_tokens_in_text_parse_only_when_asked(deployment: Deployment) -> None:
    client = deployment.client()

    def prompt_tokens(parse_special: bool) -> int:
        reply = client.completions.create(model=MODEL_NAME, prompt="<|sf_start|>", max_tokens=1,
                                          extra_body={"specfleet": {"parse_special":
                                                                    parse_special}})
        return reply.usage.prompt_tokens

    assert prompt_tokens(True) == 1  # the control token itself
    assert prompt_tokens(False) > 1  # plain text: several ordinary tokens


def test_sse_framing(deployment: Deployment) -> None:
    with httpx.stream("POST", deployment.gateway.url + "/v1/completions", timeout=30, json={
            "model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 9, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e and not e.startswith(":")]
    assert events[-1] == "data: [DONE]" and raw.endswith("data: [DONE]\n\n")
    shown = 0
    for event in events[:-1]:
        id_line, data_line = event.split("\n")
        assert id_line.startswith("id: ") and data_line.startswith("data: ")
        body = json.loads(data_line[len("data: "):])
        assert body["object"] == "text_completion"
        shown += len(body["choices"][0]["text"])
        assert int(id_line[len("id: "):]) == shown  # the id counts characters delivered
    assert json.loads(events[-2].split("data: ")[1])["choices"][0]["finish_reason"] == "length"


def test_a_client_that_hangs_up_cancels_its_job(fleet: Fleet, gateway: Gateway,
                                                settings: Settings) -> None:
    fleet.start("w1", step_delay=0.05)
    with httpx.stream("POST", gateway.url + "/v1/completions", timeout=30, json={
            "model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 400, "stream": True,
            "specfleet": {"speculative": {"method": "none"}}}) as r:
        data = next(line for line in r.iter_lines() if line.startswith("data: "))
    job_id = json.loads(data[len("data: "):])["id"].removeprefix("cmpl-")
    result = Coordinator(settings).handle(job_id).result(timeout=30)
    assert result.status is JobStatus.CANCELLED and len(result.tokens) < 400
