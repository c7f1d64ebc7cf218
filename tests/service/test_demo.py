"""``make demo`` runs end to end and leaves a shared Redis as it found it.

The demo itself (a real worker process, real jobs through the coordinator, streaming, the
clean shutdown) runs on the tiny dense model with short prompts instead of Gemma, in the
test's own namespace.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from redis import Redis
from rich.console import Console

from coordinator import demo
from shared.settings import Settings

PROMPTS = [("first", "The planets of the solar system", 6), ("second", "Lighthouses", 6)]


def test_the_demo_cleans_up_every_key_it_created(settings: Settings, dense_model: Path,
                                                  tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", settings.redis_url)
    code = demo.run(Console(file=io.StringIO(), width=120), model=dense_model, prompts=PROMPTS,
                    workdir=tmp_path, prefix=settings.prefix)
    assert code == 0, (tmp_path / "worker.log").read_text()[-3000:]
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(r["custom_id"], r["status"]) for r in results] == [("first", "finished"),
                                                               ("second", "finished")]
    conn = Redis.from_url(settings.redis_url)
    for job_id in (r["job_id"] for r in results):
        assert list(conn.scan_iter(f"*{job_id}*")) == [], job_id  # rq:job:*, rq:results:*
    assert list(conn.scan_iter(f"*{settings.prefix}*")) == []
    for index in ("rq:queues", "rq:workers"):
        assert [m for m in conn.smembers(index) if settings.prefix.encode() in m] == [], index
