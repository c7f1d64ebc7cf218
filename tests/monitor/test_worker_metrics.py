"""The worker's metrics endpoint itself: a free port when asked for 0, a clear error when the
port is taken (the worker then stops with that one line)."""

from __future__ import annotations

import socket
import urllib.request

import pytest

from worker.service.metrics import WorkerMetrics


def test_port_zero_serves_on_a_free_port_until_closed() -> None:
    metrics = WorkerMetrics("w", "m", "cpu")
    port = metrics.serve(0, addr="127.0.0.1")
    try:
        assert port == metrics.port and port > 0
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        assert b'specfleet:slots{device="cpu",model="m",worker="w"} 1.0' in body
        assert b"_created" not in body
    finally:
        metrics.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_a_taken_port_is_one_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            WorkerMetrics("w", "m", "cpu").serve(port, addr="127.0.0.1")
