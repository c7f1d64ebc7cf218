"""Every client mistake is a 4xx naming the field, never a 500 (the OpenAI SDKs retry 500s):
the probes of ``bench/fuzz.py`` (one list for the bench and here: lone surrogates, stream ids
rq cannot hold, bodies that are not JSON by their Content-Type, the fields accepted without
effect with wrong types, null and right ones), the real ``openai`` client, and a property
test of malformed bodies, ids, query strings, content types and headers against a real
gateway and worker."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import quote, urlencode

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.gateway.cross_site import UPLOAD_TYPES
from coordinator.openai_api.fields import NO_EFFECT, REFUSED
from coordinator.openai_api.requests import ChatRequest, CompletionRequest
from coordinator.openai_api.responses import ResponsesRequest

from .conftest import Deployment

from helpers import run_bench  # isort: skip
from service.workers import MODEL_NAME  # isort: skip


def _bench_fuzz() -> ModuleType:
    """``bench/fuzz.py``, whose probe list and checks these tests share (bench/ is no
    package)."""
    path = Path(__file__).resolve().parents[2] / "bench" / "fuzz.py"
    spec = importlib.util.spec_from_file_location("bench_fuzz", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


fuzz = _bench_fuzz()
PROBES = fuzz.probes(MODEL_NAME)
#: Bounded and reproducible: the same examples on every run, no example database written.
BOUNDED = settings(max_examples=150, deadline=None, derandomize=True, database=None)


@pytest.fixture(scope="module")
def http(deployment: Deployment) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=deployment.gateway.url, timeout=60) as client:
        yield client


@pytest.mark.parametrize("probe", PROBES, ids=[p.name for p in PROBES])
def test_each_probe_is_answered_as_expected(http: httpx.Client, probe: Any) -> None:
    """The 500s the review found (a lone surrogate in ``model``, a stream id with ``*``) are 4xx
    naming the field; each no-effect field refuses a wrong type by name and takes null and
    a right value."""
    problem = fuzz.wrong(probe, fuzz.send(http, probe))
    assert problem is None, problem


def test_the_openai_client_hears_which_field_has_the_wrong_type(
        deployment: Deployment) -> None:
    """The SDK passes a wrong type on as given; the 400 names the field. (A lone surrogate
    it cannot even encode; JavaScript's JSON.stringify sends one as ``\\ud800``, as the
    probes do.)"""
    client = deployment.client()
    for field, value in (("user", 5), ("metadata", {"k": 1}), ("store", "yes")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL_NAME, max_tokens=1, **{field: value},
                                           messages=[{"role": "user", "content": "hi"}])
        assert info.value.body["param"].startswith(field)  # type: ignore[index]
    reply = client.chat.completions.create(model=MODEL_NAME, max_tokens=1, user="u",
                                           metadata={"k": "v"}, store=False,
                                           messages=[{"role": "user", "content": "hi"}])
    assert reply.usage is not None and reply.usage.completion_tokens == 1


def test_a_resumed_stream_refuses_a_last_event_id_that_is_no_number(
        deployment: Deployment, http: httpx.Client) -> None:
    """``"²".isdigit()`` is true, and ``int("²")`` a ValueError: it was a 500."""
    stream = deployment.client().completions.create(model=MODEL_NAME, prompt="hi",
                                                     max_tokens=2, stream=True)
    completion_id = [chunk.id for chunk in stream][0]
    path = f"/v1/specfleet/streams/{completion_id}"
    for last in (b"\xb2", b"-1", b"x"):
        refused = http.get(path, headers={"Last-Event-ID": last})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "Last-Event-ID"
    assert "data: [DONE]" in http.get(path, headers={"Last-Event-ID": "1"}).text


def test_the_bench_replays_the_probes(deployment: Deployment) -> None:
    done = run_bench("fuzz.py", "--url", deployment.gateway.url, "--model", MODEL_NAME)
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(done.stdout.splitlines()) == len(PROBES) + 1  # a header, a row per probe


# --- the property test: whatever arrives, no 5xx, and every 4xx in OpenAI's shape ---

def _mostly(common: st.SearchStrategy[Any], rare: st.SearchStrategy[Any]) -> Any:
    """``common`` nine draws in ten, ``rare`` the tenth (``|`` would draw each half)."""
    return st.integers(0, 9).flatmap(lambda i: rare if i == 0 else common)


_surrogate = st.integers(0xD800, 0xDFFF).map(chr)
#: Text with a lone surrogate in it; any text, one time in three with one.
_lone = st.builds(lambda a, s: a + s, st.text(max_size=4), _surrogate)
_text = st.text(max_size=12) | st.text(max_size=12) | _lone
_scalars = st.none() | st.booleans() | st.integers() | st.floats() | _text
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(_text, inner, max_size=4), max_leaves=10)


def _nested(depth: int) -> Any:
    value: Any = 1
    for i in range(depth):
        value = [value] if i % 2 else {"a": value}
    return value


#: The fields the endpoints read, refuse or drop.
_FIELDS = sorted({*ChatRequest.model_fields, *CompletionRequest.model_fields,
                  *ResponsesRequest.model_fields, *NO_EFFECT, *REFUSED})
#: Fields inside fields, each given the random value ``v``.
_INSIDE = [
    lambda v: {"messages": [{"role": "user", "content": v}]},
    lambda v: {"messages": [{"role": v, "content": "hi"}]},
    lambda v: {"messages": [{"role": "assistant", "content": None, "tool_calls": v}]},
    lambda v: {"input": [{"role": "user", "content": v}]},
    lambda v: {"specfleet": {"speculative": {"method": "ngram", "draft_max": v}}},
    lambda v: {"specfleet": {"grammar": v}},
    lambda v: {"response_format": {"type": "json_schema",
                                   "json_schema": {"name": "x", "schema": v}}},
    lambda v: {"tools": [{"type": "function", "function": {"name": "f", "parameters": v}}]},
    lambda v: {"text": {"format": v}},
    lambda v: {"stream": True, "stream_options": {"include_usage": v}},
    lambda v: {"logit_bias": {"5": v}},
    lambda v: {"metadata": {"k": v}},
]


#: The text fields of a body (echoed back in some refusals: an unknown model's name).
_STRINGS = ["model", "prompt", "input", "instructions", "stop", "user", "service_tier"]


@st.composite
def _bodies(draw: st.DrawFn) -> Any:
    """A generating endpoint's one-token body with fields (top-level or inside) set to random
    values (surrogates, deep nesting and wrong types among them), text fields to random text,
    or fields removed."""
    path = draw(st.sampled_from(sorted(fuzz.bodies(MODEL_NAME))))
    body = dict(fuzz.bodies(MODEL_NAME)[path])
    for _ in range(draw(_mostly(st.just(1), st.integers(2, 3)))):  # one change: no cover
        value = draw(_mostly(_values, st.integers(1, 200).map(_nested)))
        name = draw(st.sampled_from(_FIELDS) | _text)
        how = draw(st.sampled_from(["inside", "text", "remove", "set"]))
        if how == "inside":
            body.update(draw(st.sampled_from(_INSIDE))(value))
        elif how == "text":
            body[draw(st.sampled_from(_STRINGS))] = draw(st.text(max_size=6) | _lone)
        elif how == "remove":
            body.pop(name, None)
        else:
            body[name] = value
    return fuzz.Probe("body", "POST", path, json.dumps(body).encode(), status=0)


_ids = st.text(max_size=20).map(lambda s: quote(s, safe="")) | st.binary(max_size=8).map(
    lambda b: quote(b, safe=""))
_ID_ROUTES = [("GET", "/v1/files/{}"), ("GET", "/v1/files/{}/content"),
              ("DELETE", "/v1/files/{}"), ("GET", "/v1/batches/{}"),
              ("POST", "/v1/batches/{}/cancel"), ("GET", "/v1/specfleet/streams/{}"),
              ("GET", "/v1/specfleet/streams/cmpl-{}"), ("GET", "/v1/models/{}"),
              ("DELETE", "/v1/specfleet/models/{}")]
_QUERIES = {"/v1/files": ("limit", "after", "purpose"), "/v1/batches": ("limit", "after"),
            "/v1/specfleet/streams/cmpl-0": ("include_usage",)}


@st.composite
def _ids_and_queries(draw: st.DrawFn) -> Any:
    """An id of any characters (or bytes) in a path, or any values in a query string."""
    if draw(st.booleans()):
        method, route = draw(st.sampled_from(_ID_ROUTES))
        return fuzz.Probe("id", method, route.format(draw(_ids)), headers=(), status=0)
    path, names = draw(st.sampled_from(sorted(_QUERIES.items())))
    query = {name: draw(st.text(max_size=12)) for name in names if draw(st.booleans())}
    return fuzz.Probe("query", "GET", f"{path}?{urlencode(query)}", headers=(), status=0)


#: What a header value may be (no outer blanks: h11 refuses to send those).
_printable = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E),
                     max_size=30).map(str.strip)
_content_types = _mostly(st.sampled_from([
    "application/json", "application/json; charset=utf-8", "text/plain",
    "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data",
    "application/jsonl", ""]), _printable)
#: Header values a browser, a proxy or an attacker sends, and any others.
_HEADERS = {
    "Host": _mostly(st.sampled_from(["localhost", "127.0.0.1", "[::1]", "LOCALHOST:1"]),
                    _printable),
    "Origin": _mostly(st.sampled_from(["null", "http://localhost", "https://evil.example"]),
                      _printable),
    "Sec-Fetch-Site": _mostly(st.sampled_from(["cross-site", "same-site", "same-origin",
                                               "none"]), _printable),
}


@st.composite
def _framing(draw: st.DrawFn) -> Any:
    """Any bytes under any Content-Type to any POST route, with any Host, Origin and
    Sec-Fetch-Site."""
    headers = [("Content-Type", draw(_content_types))]
    headers += [(name, draw(values)) for name, values in _HEADERS.items()
                if draw(st.integers(0, 3)) == 0]
    path = draw(st.sampled_from([*fuzz.bodies(MODEL_NAME), "/v1/batches", "/v1/files"]))
    valid = json.dumps(fuzz.bodies(MODEL_NAME).get(path, {})).encode()
    body = draw(st.just(valid) | st.binary(max_size=64)
                | _values.map(lambda v: json.dumps(v).encode()))
    return fuzz.Probe("framing", "POST", path, body, tuple(headers), status=0)


def _answer(http: httpx.Client, probe: Any) -> httpx.Response:
    """``probe``'s answer, which is no 5xx, and if a 4xx in OpenAI's error shape."""
    response = fuzz.send(http, probe)
    assert response.status_code < 500, (probe, response.status_code, response.text[:500])
    if response.status_code >= 400:
        assert fuzz.error_shape(response) is None, (probe, response.text[:500])
    return response


def _no_server_error(http: httpx.Client, probe: Any) -> None:
    _answer(http, probe)


def _never_taken_unless_json(http: httpx.Client, probe: Any) -> None:
    """A body under another Content-Type than its route's is refused, valid or not."""
    response = _answer(http, probe)
    given_type = dict(probe.headers)["Content-Type"].partition(";")[0].strip().lower()
    if given_type != UPLOAD_TYPES.get(probe.path, "application/json"):
        assert response.status_code >= 400, (probe, response.text[:500])


def test_no_malformed_body_is_a_5xx(http: httpx.Client) -> None:
    BOUNDED(given(_bodies())(lambda probe: _no_server_error(http, probe)))()


def test_no_id_or_query_string_is_a_5xx(http: httpx.Client) -> None:
    BOUNDED(given(_ids_and_queries())(lambda probe: _no_server_error(http, probe)))()


def test_no_content_type_or_header_is_a_5xx_and_only_json_is_taken(http: httpx.Client) -> None:
    BOUNDED(given(_framing())(lambda probe: _never_taken_unless_json(http, probe)))()
