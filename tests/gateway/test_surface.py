"""The OpenAI surface through a live gateway and real workers, with the real ``openai``
client: logit_bias, n > 1, prompt lists, echo, the Responses API, models.retrieve, files,
CORS, aliases, chat on a model without a template, and the 400s the fleet can judge."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
import openai
import pytest

from coordinator.client import Coordinator
from coordinator.openai_api.requests import choice_seed
from shared.settings import Settings

from .conftest import Deployment
from .gateway import Gateway

from helpers import SPECFLEET  # isort: skip
from service.workers import CTX, MODEL_NAME, Fleet  # isort: skip

PROMPT = [5, 17, 33, 2]


def _greedy(client: openai.OpenAI, **extra: object) -> list[int]:
    """The token ids of a greedy completion of PROMPT (from the ``specfleet`` job)."""
    reply = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8,
                                      temperature=0, **extra)  # type: ignore[call-overload]
    job = Coordinator(reply_settings(client)).handle(reply.specfleet["job_id"])
    return job.result(timeout=30).tokens


def reply_settings(client: openai.OpenAI) -> Settings:
    return client._specfleet_settings  # type: ignore[attr-defined, no-any-return]


@pytest.fixture
def client(deployment: Deployment) -> openai.OpenAI:
    c = deployment.client()
    c._specfleet_settings = deployment.settings  # type: ignore[attr-defined]
    return c


@pytest.mark.parametrize("method", ["none", "ngram"])
def test_logit_bias_bans_and_forces_tokens_in_the_sampler(client: openai.OpenAI,
                                                          method: str) -> None:
    """-100 on the greedy first token: it never comes; +100 on one token: every token is it.
    Speculating or not gives the same tokens (the bias is in the target distribution). The
    comparison is with plain decoding: the default drafter (suffix) drafts this prompt's
    cached outputs at its first token, and this model's biased target has two tokens 1e-6
    apart there, which a wider verify may round the other way."""
    spec = {"specfleet": {"speculative": {"method": method}}}
    plain = _greedy(client, extra_body=spec)
    banned = _greedy(client, extra_body={**spec, "logit_bias": {str(plain[0]): -100}})
    assert plain[0] not in banned
    none = {"specfleet": {"speculative": {"method": "none"}}}
    assert banned == _greedy(client, extra_body={**none, "logit_bias": {str(plain[0]): -100}})
    forced = _greedy(client, extra_body={**spec, "logit_bias": {"77": 100}})
    assert forced == [77] * 8
    sampled = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8,
                                        temperature=1.0, seed=3, logit_bias={"77": 100},
                                        extra_body=spec)
    assert sampled.specfleet["telemetry"]["generated_tokens"] == 8
    job = Coordinator(reply_settings(client)).handle(sampled.specfleet["job_id"])
    assert job.result(timeout=30).tokens == [77] * 8


def test_n_samples_and_prompt_lists_are_choices(client: openai.OpenAI) -> None:
    ask = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=9)
    two = client.completions.create(n=3, **ask)  # type: ignore[call-overload]
    assert [c.index for c in two.choices] == [0, 1, 2]
    one = client.completions.create(**ask)  # type: ignore[call-overload]
    assert two.choices[0].text == one.choices[0].text  # choice 0 samples with the seed
    again = client.completions.create(n=3, **ask)  # type: ignore[call-overload]
    assert [c.text for c in again.choices] == [c.text for c in two.choices]
    assert two.usage.prompt_tokens == 4 and two.usage.completion_tokens == 18
    # each choice sampled with its own seed, derived from the request's: reproducible alone
    seeds = [c["seed"] for c in two.specfleet["choices"]]
    assert seeds == [choice_seed(9, i) for i in range(3)]
    alone = client.completions.create(**{**ask, "seed": seeds[2]})  # type: ignore[call-overload]
    assert alone.choices[0].text == two.choices[2].text
    listed = client.completions.create(model=MODEL_NAME, prompt=[PROMPT, [9, 8, 7]],
                                       max_tokens=4, temperature=0)
    assert [c.index for c in listed.choices] == [0, 1]
    alone = client.completions.create(model=MODEL_NAME, prompt=[9, 8, 7], max_tokens=4,
                                      temperature=0)
    assert listed.choices[1].text == alone.choices[0].text
    assert listed.usage.prompt_tokens == 7
    streamed = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=5,
        seed=4, stream=True, stream_options={"include_usage": True})
    texts = {0: "", 1: ""}
    finished = set()
    chunks = list(streamed)
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    whole = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=5,
        seed=4)
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finished == {0, 1} and chunks[-1].usage.completion_tokens == 10


def test_echo_puts_the_prompt_first(client: openai.OpenAI) -> None:
    plain = client.completions.create(model=MODEL_NAME, prompt="tok_5 tok_9", max_tokens=4,
                                      temperature=0)
    echoed = client.completions.create(model=MODEL_NAME, prompt="tok_5 tok_9", max_tokens=4,
                                       temperature=0, echo=True)
    assert echoed.choices[0].text == "tok_5 tok_9" + plain.choices[0].text
    stream = client.completions.create(model=MODEL_NAME, prompt="tok_5 tok_9", max_tokens=4,
                                       temperature=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in stream) == echoed.choices[0].text


def test_requests_the_fleet_can_judge_are_400s(deployment: Deployment,
                                              client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as long_ids:
        client.completions.create(model=MODEL_NAME, prompt=[5] * (CTX - 10), max_tokens=64)
    assert long_ids.value.body["code"] == "context_length_exceeded"
    message = long_ids.value.message
    assert f"({CTX} tokens)" in message and "max_tokens (64)" in message
    # text: only the worker counts its tokens; it refuses before generating
    with pytest.raises(openai.BadRequestError) as long_text:
        client.completions.create(model=MODEL_NAME, prompt="tok_1 " * 2000, max_tokens=200)
    assert long_text.value.body["code"] == "context_length_exceeded"
    for ids in ([5, 999], [10**30]):
        with pytest.raises(openai.BadRequestError) as outside:
            client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=2)
        assert outside.value.body["param"] == "prompt_tokens"
        assert "outside the vocabulary" in outside.value.message
    with pytest.raises(openai.BadRequestError) as bias:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, logit_bias={"5000": 1})
    assert bias.value.body["param"] == "sampling.logit_bias"
    # a stream a worker refuses at once is answered with the status, not a 200
    with pytest.raises(openai.BadRequestError) as streamed:
        list(client.completions.create(model=MODEL_NAME, prompt="tok_1 " * 2000, max_tokens=200,
                                       stream=True))
    assert streamed.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as slashed:
        client.completions.create(model="org/model", prompt=PROMPT, max_tokens=2)
    assert slashed.value.body["code"] == "model_not_found"
    deep = b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = httpx.post(deployment.gateway.url + "/v1/completions", content=deep, timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "deeper than 64" in r.json()["error"]["message"]


def test_models_retrieve_and_the_chat_template_shown(client: openai.OpenAI) -> None:
    model = client.models.retrieve(MODEL_NAME)
    assert model.id == MODEL_NAME and model.specfleet["chat_templates"] == ["gguf"]
    assert model.specfleet["vocab_size"] == 256
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_responses_plain_and_streamed(client: openai.OpenAI) -> None:
    reply = client.responses.create(model=MODEL_NAME, input="hi", instructions="be brief",
                                    max_output_tokens=6, temperature=0)
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.output_text and reply.usage.output_tokens == 6
    chat = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=6, temperature=0,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert reply.output_text == chat.choices[0].message.content
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    events = list(client.responses.create(model=MODEL_NAME, input="hi", instructions="be brief",
                                          max_output_tokens=6, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == reply.output_text == events[-1].response.output_text


def test_files_list_retrieve_delete_and_cors(settings: Settings, fleet: Fleet,
                                             tmp_path: Path) -> None:
    gateway = Gateway(settings, tmp_path, env={"SPECFLEET_API_KEYS": "k1"}, args=(
        "--cors-origins", "https://app.example", "--model-alias", f"gpt-4o-mini={MODEL_NAME}",
    )).start()
    try:
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="k1", max_retries=0)
        uploaded = client.files.create(file=("a.jsonl", b'{"x": 1}\n'), purpose="batch")
        listed = client.files.list()
        assert [f.id for f in listed.data] == [uploaded.id]
        got = client.files.retrieve(uploaded.id)
        assert got.bytes == 9 and got.expires_at and got.expires_at > got.created_at
        assert client.files.delete(uploaded.id).deleted is True
        assert client.files.list().data == []
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(uploaded.id)
        preflight = httpx.options(gateway.url + "/v1/chat/completions", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"
        other = httpx.options(gateway.url + "/v1/models", headers={
            "Origin": "https://evil.example", "Access-Control-Request-Method": "GET"})
        assert "access-control-allow-origin" not in other.headers
        fleet.start("w1")
        assert client.models.retrieve("gpt-4o-mini").specfleet["alias_of"] == MODEL_NAME
        [served] = client.models.list().data  # one entry per model, its aliases listed
        assert served.id == MODEL_NAME and served.specfleet["aliases"] == ["gpt-4o-mini"]
        reply = client.completions.create(model="gpt-4o-mini", prompt=PROMPT, max_tokens=2)
        assert reply.model == "gpt-4o-mini" and reply.usage.completion_tokens == 2
    finally:
        gateway.stop()


def test_without_cors_origins_there_are_no_cors_headers(deployment: Deployment) -> None:
    r = httpx.options(deployment.gateway.url + "/v1/models", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "GET"})
    assert "access-control-allow-origin" not in r.headers and r.status_code == 405


def test_chat_works_on_a_model_without_a_template(settings: Settings, dense_model: Path,
                                                  tmp_path: Path) -> None:
    """The dense tiny GGUF has no ``tokenizer.chat_template`` and no known turn markers:
    the worker renders chats with the default (ChatML) and says so in /v1/models."""
    plain = Fleet(settings, dense_model, tmp_path)
    gateway = Gateway(settings, tmp_path).start()
    try:
        plain.start("plain")
        c = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
        reply = c.chat.completions.create(model=MODEL_NAME, max_tokens=3,
                                          messages=[{"role": "user", "content": "x"}])
        assert reply.usage.completion_tokens == 3
        assert c.models.retrieve(MODEL_NAME).specfleet["chat_templates"] == ["default:chatml"]
    finally:
        gateway.stop()
        plain.stop_all()


def test_cached_prompt_tokens_are_reported_in_usage(client: openai.OpenAI) -> None:
    """A prompt sent again is served from the worker's prefix cache; ``usage`` says how much
    (``prompt_tokens_details.cached_tokens``: chat, completions, streamed, and the Responses
    API's ``input_tokens_details``)."""
    prompt = [7, 8, 9, 10, 11, 12] * 8
    client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2,
                                      temperature=0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached <= len(prompt) == again.usage.prompt_tokens
    assert cached == again.specfleet["telemetry"]["cached_tokens"]
    streamed = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2,
                                              temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens > 0
    turns = [{"role": "user", "content": "tok_3 tok_4 tok_5 " * 6}]
    client.chat.completions.create(model=MODEL_NAME, messages=turns, max_tokens=2)  # type: ignore[arg-type]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=turns, max_tokens=2)  # type: ignore[arg-type]
    assert chat.usage.prompt_tokens_details.cached_tokens > 0
    reply = client.responses.create(model=MODEL_NAME, input=turns[0]["content"],
                                    max_output_tokens=2)
    assert reply.usage.input_tokens_details.cached_tokens > 0


def test_serve_refuses_a_malformed_alias_by_its_option(settings: Settings) -> None:
    env = {**os.environ, "REDIS_URL": settings.redis_url, "SPECFLEET_PREFIX": settings.prefix}
    for alias, why in (("nope", "is not ALIAS=MODEL"), (f"a={MODEL_NAME}", "names two models")):
        args = ["--model-alias", alias] if "=" not in alias else [
            "--model-alias", alias, "--model-alias", "a=other"]
        done = subprocess.run([SPECFLEET, "serve", "--port", "0", *args], env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and "--model-alias" in done.stderr and why in done.stderr


@pytest.mark.gemma
def test_the_readme_chat_example_on_the_demo_model(settings: Settings, gemma_path: Path,
                                                   tmp_path: Path) -> None:
    """The README's curl body on Gemma 3 270M, whose GGUF has no chat template: a 200 with
    an answer, rendered in Gemma's turns (``architecture:gemma``)."""
    fleet = Fleet(settings, gemma_path, tmp_path)
    gateway = Gateway(settings, tmp_path).start()
    try:
        fleet.start("demo", args=("--ctx", "1024"))
        r = httpx.post(gateway.url + "/v1/chat/completions", timeout=120, json={
            "model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello"}]})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
        model = httpx.get(gateway.url + f"/v1/models/{MODEL_NAME}").json()
        assert model["specfleet"]["chat_templates"] == ["architecture:gemma"]
    finally:
        gateway.stop()
        fleet.stop_all()
