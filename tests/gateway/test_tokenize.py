"""``/tokenize`` and ``/detokenize`` in llama-server's and vLLM's shapes, and an embedding of
the real model's width, through a live gateway and a Gemma 3 270M worker."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from shared.protocol import GenerationRequest
from worker.engine.prompt import build_prompt
from worker.llm.model import Model, ModelSpec

from .conftest import Deployment, deployed, deployment_settings

from service.workers import MODEL_NAME as MODEL  # isort: skip

CTX = 1024
TEXT = "What is the capital of France? Ünïcode 媽 and emoji 🤗"


@pytest.fixture(scope="module")
def gemma_fleet(gemma_path: Path, tmp_path_factory: pytest.TempPathFactory,
                ) -> Iterator[Deployment]:
    with deployed(deployment_settings("tok"), gemma_path, tmp_path_factory.mktemp("tok"),
                  worker="g1", args=("--ctx", str(CTX), "--embeddings", "32"),
                  register_timeout=180) as d:
        yield d


@pytest.fixture(scope="module")
def gemma(gemma_path: Path) -> Iterator[Model]:
    with Model(ModelSpec(str(gemma_path))) as model:
        yield model


def _post(fleet: Deployment, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(fleet.gateway.url + path, json={"model": MODEL, **body}, timeout=60)


def test_tokenize_agrees_with_the_workers_tokenizer_and_round_trips(
        gemma_fleet: Deployment, gemma: Model) -> None:
    """llama-server's shape adds no special tokens unless asked, vLLM's adds them to a prompt
    (as a completion's prompt has them) and renders a chat as a chat completion's prompt;
    ``/detokenize`` gives the text back; pieces are each token's text."""
    plain = _post(gemma_fleet, "/tokenize", {"content": TEXT}).json()
    assert plain["tokens"] == gemma.tokenize(TEXT, add_special=False)
    assert plain["count"] == len(plain["tokens"]) and plain["max_model_len"] == CTX
    bos = _post(gemma_fleet, "/tokenize", {"content": TEXT, "add_special": True}).json()
    assert bos["tokens"] == gemma.tokenize(TEXT) != plain["tokens"]
    vllm = _post(gemma_fleet, "/tokenize", {"prompt": TEXT}).json()
    assert vllm["tokens"] == bos["tokens"]
    assert _post(gemma_fleet, "/tokenize", {"prompt": TEXT, "add_special_tokens": False}
                 ).json()["tokens"] == plain["tokens"]

    back = _post(gemma_fleet, "/detokenize", {"tokens": plain["tokens"]}).json()
    assert back["content"] == back["prompt"] == TEXT

    pieces = _post(gemma_fleet, "/tokenize", {"content": TEXT, "with_pieces": True}).json()
    assert [p["id"] for p in pieces["tokens"]] == plain["tokens"]
    assert b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"])
                    for p in pieces["tokens"]) == TEXT.encode()
    strs = _post(gemma_fleet, "/tokenize", {"prompt": "Paris", "return_token_strs": True,
                                            "add_special_tokens": False}).json()
    assert "".join(strs["token_strs"]) == "Paris"

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": TEXT}]
    chat = _post(gemma_fleet, "/tokenize", {"messages": messages}).json()
    assert chat["tokens"] == build_prompt(gemma, GenerationRequest.model_validate(
        {"model": MODEL, "messages": messages}))


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {"content": "a", "prompt": "b"}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special": True, "add_special_tokens": True}, 400,
     "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}],
                   "add_generation_prompt": False}, 400, "add_generation_prompt"),
    ("/tokenize", {"prompt": "a", "chat_template": "x"}, 400, "chat_template"),
    ("/tokenize", {"content": 5}, 400, "content"),
    ("/detokenize", {"tokens": [1, 300000]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
    ("/detokenize", {"tokens": [1], "model": "nope"}, 404, "model"),
])
def test_tokenizer_refusals_name_the_field(gemma_fleet: Deployment, path: str,
                                           body: dict[str, Any], status: int,
                                           param: str) -> None:
    reply = _post(gemma_fleet, path, body)
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["param"] == param


def test_embeddings_have_the_models_width(gemma_fleet: Deployment, gemma: Model) -> None:
    vectors = gemma_fleet.client().embeddings.create(model=MODEL, input=["Paris", "Lyon"])
    assert [len(d.embedding) for d in vectors.data] == [gemma.n_embd_out] * 2 == [640, 640]
