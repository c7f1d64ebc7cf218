"""``/v1/embeddings`` through a live gateway and a real worker started with ``--embeddings``,
driven with the real ``openai`` client."""

from __future__ import annotations

import base64
import io
import json
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest

from worker.engine.embedding import SHARED_INPUT_TOKENS
from worker.llm.model import Model, ModelSpec

from .conftest import Deployment, deployed, deployment_settings

from service.workers import MODEL_NAME  # isort: skip

#: The worker's embedding context: the longest input, in tokens.
EMBEDDING_TOKENS = 128
TEXTS = ["the fleet decodes", "Redis keeps the queues", "a third, longer input to embed here"]


@pytest.fixture(scope="module")
def embedding_fleet(chat_model: Path, tmp_path_factory: pytest.TempPathFactory,
                    ) -> Iterator[Deployment]:
    """One two-slot worker with an embedding context, and a gateway."""
    with deployed(deployment_settings("emb"), chat_model, tmp_path_factory.mktemp("emb"),
                  args=("--ctx", "512", "--slots", "2",
                        "--embeddings", str(EMBEDDING_TOKENS))) as d:
        yield d


@pytest.fixture(scope="module")
def tokenizer(chat_model: Path) -> Iterator[Model]:
    with Model(ModelSpec(str(chat_model))) as model:
        yield model


def _vectors(reply: openai.types.CreateEmbeddingResponse) -> np.ndarray:
    return np.array([d.embedding for d in reply.data], dtype=np.float64)


def test_embeddings_answer_the_openai_client(embedding_fleet: Deployment,
                                             tokenizer: Model) -> None:
    """OpenAI's shape: one unit vector of the model's width per input, in order; usage counts
    the tokens read; the client's default (base64, decoded by the client), ``float`` and
    ``base64`` carry the same float32 values; a repeated input gets the same vector."""
    client = embedding_fleet.client()
    texts = [*TEXTS, TEXTS[0]]
    default = client.embeddings.create(model=MODEL_NAME, input=texts, user="someone")
    assert default.object == "list" and default.model == MODEL_NAME
    assert [d.index for d in default.data] == [0, 1, 2, 3]
    vectors = _vectors(default)
    assert vectors.shape == (4, tokenizer.n_embd_out)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-6)
    assert (vectors[0] == vectors[3]).all()
    assert not np.allclose(vectors[0], vectors[1])
    tokens = sum(len(tokenizer.tokenize(t)) for t in texts)
    assert default.usage.prompt_tokens == default.usage.total_tokens == tokens
    [worker] = client.models.retrieve(MODEL_NAME).specfleet["workers"]  # type: ignore[attr-defined]
    assert worker["embedding_tokens"] == EMBEDDING_TOKENS

    floats = client.embeddings.create(model=MODEL_NAME, input=texts, encoding_format="float")
    assert (_vectors(floats) == vectors).all()
    raw = client.embeddings.create(model=MODEL_NAME, input=texts, encoding_format="base64")
    for d, row in zip(raw.data, vectors, strict=True):
        assert isinstance(d.embedding, str)
        decoded = base64.b64decode(d.embedding)
        assert struct.unpack(f"<{len(decoded) // 4}f", decoded) == tuple(row)


def test_token_ids_embed_as_their_text_does(embedding_fleet: Deployment,
                                            tokenizer: Model) -> None:
    """A list of token ids is one input; a list of lists several; the ids of a text give its
    vector bit for bit (the same decode), and a single string is one input too."""
    client = embedding_fleet.client()
    ids = [tokenizer.tokenize(t) for t in TEXTS]
    by_text = _vectors(client.embeddings.create(model=MODEL_NAME, input=TEXTS,
                                                encoding_format="float"))
    by_ids = _vectors(client.embeddings.create(model=MODEL_NAME, input=ids,
                                               encoding_format="float"))
    assert (by_ids == by_text).all()
    one = client.embeddings.create(model=MODEL_NAME, input=ids[1], encoding_format="float")
    alone = client.embeddings.create(model=MODEL_NAME, input=TEXTS[1], encoding_format="float")
    assert len(one.data) == len(alone.data) == 1
    assert one.data[0].embedding == alone.data[0].embedding
    assert one.usage.prompt_tokens == len(ids[1])


def test_a_text_keeps_its_vector_in_another_batch(embedding_fleet: Deployment,
                                                  tokenizer: Model) -> None:
    """A short and a longer input, each alone, twice, and among inputs of other lengths in
    other positions: the same float32 vector every time (worker/engine/embedding.py)."""
    client = embedding_fleet.client()
    short, longer = "a few words", f"{TEXTS[2]}, and {TEXTS[1]}"
    lengths = [len(tokenizer.tokenize(text)) for text in (short, longer)]
    assert lengths[0] < SHARED_INPUT_TOKENS <= lengths[1]
    crowd = ["x " * 40, "some", short, "other words", longer, "and one more"]
    mixed = _vectors(client.embeddings.create(model=MODEL_NAME, input=crowd,
                                              encoding_format="float"))
    for text in (short, longer):
        for _ in range(2):
            alone = _vectors(client.embeddings.create(model=MODEL_NAME, input=text,
                                                      encoding_format="float"))[0]
            assert (alone == mixed[crowd.index(text)]).all(), text


def test_a_batch_runs_embedding_lines(embedding_fleet: Deployment) -> None:
    """OpenAI's Batch API with url /v1/embeddings: every line an embedding job, its output
    line the answer /v1/embeddings gives (float by default, base64 when asked), and a bad
    line failed alone, naming its field."""
    client = embedding_fleet.client()
    bodies = [{"model": MODEL_NAME, "input": TEXTS},
              {"model": MODEL_NAME, "input": TEXTS[1], "encoding_format": "base64"},
              {"model": MODEL_NAME, "input": ["fine", ""]}]
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/embeddings",
                         "body": body}) for i, body in enumerate(bodies)]
    upload = client.files.create(file=("embed.jsonl", io.BytesIO("\n".join(lines).encode())),
                                 purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings",
                                  completion_window="24h")
    deadline = time.monotonic() + 60
    while (batch := client.batches.retrieve(batch.id)).status not in (
            "completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.2)
    assert batch.status == "completed" and batch.endpoint == "/v1/embeddings"
    assert batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 1)
    assert batch.output_file_id is not None and batch.error_file_id is not None
    out = [json.loads(line)
           for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert [line["custom_id"] for line in out] == ["r0", "r1"]
    direct = client.embeddings.create(model=MODEL_NAME, input=TEXTS, encoding_format="float")
    body = out[0]["response"]["body"]
    assert out[0]["response"]["status_code"] == 200 and out[0]["error"] is None
    assert body["object"] == "list" and body["model"] == MODEL_NAME
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert [d["embedding"] for d in body["data"]] == [d.embedding for d in direct.data]
    assert body["usage"] == {"prompt_tokens": direct.usage.prompt_tokens,
                             "total_tokens": direct.usage.total_tokens}
    encoded = base64.b64decode(out[1]["response"]["body"]["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(encoded) // 4}f", encoded)) == direct.data[1].embedding
    [error] = [json.loads(line)
               for line in client.files.content(batch.error_file_id).text.splitlines()]
    assert error["custom_id"] == "r2" and error["response"]["status_code"] == 400
    message = error["error"]["message"]
    assert message.startswith("line 3: ") and "input.1" in message


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": ["a", ""]}, "input.1"),
    ({"input": ["a", [1, 2]]}, "input"),
    ({"input": [[3, -1]]}, "input.0.1"),
    ({"input": [[1], [True]]}, "input.1.0"),
    ({"input": 5}, "input"),
    ({"input": ["a"] * 2049}, "input"),
    ({"input": "a", "dimensions": 32}, "dimensions"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "a", "user": 7}, "user"),
    ({"input": "a", "guided_json": {}}, "guided_json"),
    ({"input": [[1, 2, 100000]]}, "input.0"),  # outside the vocabulary (checked at submit)
    ({"input": [list(range(2, 2 + EMBEDDING_TOKENS + 1))]}, "input.0"),  # past the context
    ({"input": ["ok", "word " * 200]}, "input.1"),  # too long once the worker tokenizes it
])
def test_bad_inputs_are_400s_naming_the_field(embedding_fleet: Deployment,
                                              body: dict[str, object], param: str) -> None:
    client = embedding_fleet.client()
    with pytest.raises(openai.BadRequestError) as caught:
        client.post("/embeddings", body={"model": MODEL_NAME, **body}, cast_to=object)
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == param, caught.value.body  # type: ignore[index]


def test_a_worker_without_an_embedding_context_is_named(deployment: Deployment) -> None:
    """The shared deployment's worker was started without ``--embeddings``: a 400 that names
    the model and says how to serve them, before anything is queued."""
    with pytest.raises(openai.BadRequestError) as caught:
        deployment.client().embeddings.create(model=MODEL_NAME, input="hello")
    body = caught.value.body
    assert body["param"] == "model" and "--embeddings" in body["message"]  # type: ignore[index]
