"""OpenAI's sampling and logprob fields, read into our request and written back in OpenAI's
shapes (no fleet needed: the translation itself, end to end runs in test_openai.py)."""

from __future__ import annotations

from typing import Any

import pytest

from coordinator.events import StreamCursor, TextDeltas
from coordinator.openai_api import replies
from coordinator.openai_api import requests as schemas
from coordinator.openai_api.fields import RequestError
from shared.protocol import (
    FinalEvent,
    GenerationRequest,
    JobStatus,
    TokenEvent,
    TokenLogprob,
    TopLogprob,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": [1, 2, 3]}


def _ours(endpoint: str, body: dict[str, Any]) -> GenerationRequest:
    [choice] = schemas.parse_body(endpoint, body).choices
    return GenerationRequest.model_validate(choice.request)


def _refusal(endpoint: str, body: dict[str, Any]) -> tuple[str | None, str]:
    with pytest.raises(RequestError) as info:
        schemas.parse_body(endpoint, body)
    return info.value.param, str(info.value)


def _reply(endpoint: str, final: FinalEvent) -> dict[str, Any]:
    return replies.response_body(schemas.Parsed(endpoint, "m", [schemas.Choice({})]), [final])


def test_temperature_defaults_to_openais_one_and_zero_is_greedy() -> None:
    assert _ours(schemas.CHAT, CHAT).sampling.temperature == 1.0
    assert _ours(schemas.COMPLETIONS, COMPLETION).sampling.temperature == 1.0
    greedy = _ours(schemas.CHAT, {**CHAT, "temperature": 0})
    assert greedy.sampling.greedy
    # sampling no longer switches speculation off: unset settings are the worker's
    assert "speculative" not in greedy.model_fields_set
    assert _ours(schemas.CHAT, {**CHAT, "temperature": 0.7}).speculative.method == "auto"


def test_every_openai_and_vllm_sampling_field_reaches_the_request() -> None:
    body = {**COMPLETION, "temperature": 0.7, "top_p": 0.9, "seed": 42,
            "presence_penalty": 0.5, "frequency_penalty": -0.5, "top_k": 40, "min_p": 0.05,
            "repetition_penalty": 1.1, "logit_bias": {"3": -100, "9": 2.5}}
    sampling = _ours(schemas.COMPLETIONS, body).sampling
    assert sampling.model_dump() == {
        "temperature": 0.7, "top_p": 0.9, "seed": 42, "presence_penalty": 0.5,
        "frequency_penalty": -0.5, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1,
        "logit_bias": {3: -100.0, 9: 2.5}}
    assert _ours(schemas.CHAT, {**CHAT, "top_k": -1}).sampling.top_k == 0  # vLLM's "off"


def test_speculative_settings_pass_only_what_was_set() -> None:
    req = _ours(schemas.CHAT, {**CHAT, "temperature": 0.8,
                               "specfleet": {"speculative": {"method": "ngram"}}})
    assert req.speculative.method == "ngram"
    assert req.speculative.model_fields_set == {"method"}  # draft_max: the worker's


@pytest.mark.parametrize(("body", "param", "fragment"), [
    ({"temperature": 2.5}, "temperature", "less than or equal to 2"),
    ({"temperature": True}, "temperature", "valid number"),
    ({"top_p": 0}, "top_p", "greater than 0"),
    ({"top_p": 1.5}, "top_p", "less than or equal to 1"),
    ({"min_p": -0.1}, "min_p", "greater than or equal to 0"),
    ({"top_k": -2}, "top_k", "greater than or equal to -1"),
    ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ({"presence_penalty": 3}, "presence_penalty", "less than or equal to 2"),
    ({"frequency_penalty": -2.5}, "frequency_penalty", "greater than or equal to -2"),
    ({"seed": -1}, "seed", "greater than or equal to 0"),
    ({"seed": "7"}, "seed", "valid integer"),
    ({"logprobs": 1}, "logprobs", "valid boolean"),
    ({"top_logprobs": 3}, "top_logprobs", "top_logprobs needs logprobs: true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
])
def test_chat_sampling_refusals_name_the_field(body: dict[str, Any], param: str,
                                                fragment: str) -> None:
    where, message = _refusal(schemas.CHAT, {**CHAT, **body})
    assert where == param and fragment in message


def test_completions_take_the_legacy_integer_logprobs() -> None:
    req = _ours(schemas.COMPLETIONS, {**COMPLETION, "logprobs": 3})
    assert (req.logprobs, req.top_logprobs) == (True, 3)
    assert _ours(schemas.COMPLETIONS, {**COMPLETION, "logprobs": 0}).logprobs_k == 0
    assert _ours(schemas.COMPLETIONS, COMPLETION).logprobs_k is None
    assert _refusal(schemas.COMPLETIONS, {**COMPLETION, "logprobs": 6})[0] == "logprobs"
    assert _refusal(schemas.COMPLETIONS, {**COMPLETION, "logprobs": True})[0] == "logprobs"
    chat = _ours(schemas.CHAT, {**CHAT, "logprobs": True, "top_logprobs": 2})
    assert chat.logprobs_k == 2
    assert _ours(schemas.CHAT, {**CHAT, "logprobs": True}).logprobs_k == 0
    assert _ours(schemas.CHAT, {**CHAT, "logprobs": False, "top_logprobs": 0}).logprobs_k is None


def _lp(token: int, text: str, logprob: float, *alts: tuple[int, str, float]) -> TokenLogprob:
    return TokenLogprob(token=token, text=text, bytes=list(text.encode()), logprob=logprob,
                        top_logprobs=[TopLogprob(token=t, text=x, bytes=list(x.encode()),
                                                 logprob=v) for t, x, v in alts])


LOGPROBS = [_lp(5, "He", -0.1, (5, "He", -0.1), (9, "A", -2.5)),
            _lp(6, "llo", -0.7, (7, "y", -0.6), (6, "llo", -0.7))]
FINAL = FinalEvent(job_id="j1", attempt=1, seq=5, status=JobStatus.FINISHED,
                   finish_reason="length", tokens=[5, 6], text="Hello", seed=1234,
                   logprobs=LOGPROBS)


def test_chat_logprobs_are_in_openais_shape() -> None:
    body = _reply(schemas.CHAT, FINAL)
    content = body["choices"][0]["logprobs"]["content"]
    assert content[1] == {"token": "llo", "logprob": -0.7, "bytes": [108, 108, 111],
                          "top_logprobs": [{"token": "y", "logprob": -0.6, "bytes": [121]},
                                           {"token": "llo", "logprob": -0.7,
                                            "bytes": [108, 108, 111]}]}
    assert body["specfleet"]["seed"] == 1234
    chunk = replies.chunk(schemas.CHAT, "j1", "m", 0, text="llo", logprobs=LOGPROBS[1:])
    assert chunk["choices"][0]["logprobs"]["content"] == content[1:]
    unasked = FINAL.model_copy(update={"logprobs": None})
    assert _reply(schemas.CHAT, unasked)["choices"][0]["logprobs"] is None


def test_completion_logprobs_are_in_the_legacy_shape() -> None:
    logprobs = _reply(schemas.COMPLETIONS, FINAL)["choices"][0]["logprobs"]
    assert logprobs == {"tokens": ["He", "llo"], "token_logprobs": [-0.1, -0.7],
                        # the chosen token and its alternatives: up to logprobs + 1 entries
                        "top_logprobs": [{"He": -0.1, "A": -2.5}, {"y": -0.6, "llo": -0.7}],
                        "text_offset": [0, 2]}
    chunk = replies.chunk(schemas.COMPLETIONS, "j1", "m", 0, text="llo",
                          logprobs=LOGPROBS[1:], offset=2)
    assert chunk["choices"][0]["logprobs"]["text_offset"] == [2]


def _token_event(attempt: int, seq: int, index: int, pieces: list[str]) -> TokenEvent:
    return TokenEvent(job_id="j1", attempt=attempt, seq=seq, index=index,
                      tokens=list(range(index, index + len(pieces))), text="".join(pieces),
                      logprobs=[_lp(index + i, p, -0.5) for i, p in enumerate(pieces)])


def test_stream_logprobs_are_handed_out_once_across_duplicates_and_re_runs() -> None:
    """A duplicated token event (a retried write) and a re-run after a crash (same seed: the
    same tokens again) add no logprobs twice; a client resuming at character 3 gets those of
    the tokens after it only."""
    events = [_token_event(1, 1, 0, ["ab", "c"]), _token_event(1, 2, 0, ["ab", "c"]),
              _token_event(2, 3, 0, ["ab", "c", "de"]), _token_event(2, 4, 3, ["f"])]
    deltas = TextDeltas(StreamCursor("j1"))
    handed = []
    for event in events:
        text = deltas.feed(event)
        handed.append((text, [lp.text for lp in deltas.logprobs]))
    assert handed == [("abc", ["ab", "c"]), ("", []), ("de", ["de"]), ("f", ["f"])]
    resumed = TextDeltas(StreamCursor("j1"), shown=3)
    texts = [(resumed.feed(e), [lp.text for lp in resumed.logprobs]) for e in events]
    assert texts == [("", []), ("", []), ("de", ["de"]), ("f", ["f"])]
