"""The worker's metrics endpoint itself: a free port when asked for 0, a clear error when the
port is taken (the worker then stops with that one line); and a fallback counted on each
device it left."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client import generate_latest

from shared.protocol import CheckpointMode, SpecMethod, Telemetry
from worker.service.metrics import WorkerMetrics

from .scrape import by_label


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


def test_a_generation_fallback_counts_once_on_each_device_it_left() -> None:
    """A slot whose checkpoint spanned two RPC devices fell back during its generation: the
    per-device counter has one on each of them (and nothing on the host), beside the
    by-reason count."""
    metrics = WorkerMetrics("w", "m", "cpu,RPC[a:1],RPC[b:2]")
    metrics.job_started("j")
    metrics.job_finished("j", Telemetry(
        spec_method=SpecMethod.MTP, host_fallbacks=1, host_fallback_reason="short_write",
        host_fallback_devices=["RPC0[a:1]", "RPC0[b:2]"], checkpoint_mode=CheckpointMode.HOST),
        "finished")
    text = generate_latest(metrics.registry).decode()
    assert by_label(text, "specfleet:checkpoint_device_host_fallbacks_total",
                    "checkpoint_device") == {"RPC0[a:1]": 1.0, "RPC0[b:2]": 1.0}
    assert by_label(text, "specfleet:checkpoint_host_fallbacks_total", "reason") == {
        "short_write": 1.0}
