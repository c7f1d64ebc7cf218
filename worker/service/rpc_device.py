"""``python -m worker.service.rpc_device``: this host's CPU as one llama.cpp RPC device.

A worker's model can span devices on other processes or hosts through llama.cpp's RPC
backend (``specfleet worker --rpc HOST:PORT,...``). llama.cpp ships ``rpc-server`` for the
other end; this is the same server (``ggml_backend_rpc_start_server`` on the CPU device) from
the llama-cpp-python a worker already has, so no separate binary is needed::

    python -m worker.service.rpc_device --port 50052 [--host 127.0.0.1] [--threads 2] [--cache DIR]

It serves one client at a time, for as long as that client keeps its connection (a worker:
its whole life). Like ``rpc-server`` it has no authentication: bind it to loopback or a
private network only (a warning says so otherwise). The device reports the host's memory;
a worker that must leave room for other tenants passes its share with ``--budget-mib``.
"""

from __future__ import annotations

import argparse
import ipaddress
import signal
import sys

from shared.logs import configure_logging, get_logger

log = get_logger("rpc_device")


def _args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m worker.service.rpc_device",
                                     description="serve this host's CPU as a llama.cpp RPC device")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, required=True, help="port to listen on (1-65535)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for the device")
    parser.add_argument("--cache", default=None, metavar="DIR",
                        help="keep received weights in DIR, so a restarted worker's next load "
                             "skips sending them (llama.cpp's rpc-server --cache)")
    args = parser.parse_args(argv)
    if not 1 <= args.port <= 65535:
        parser.error(f"--port must be 1..65535, got {args.port}")
    if args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    return args


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    configure_logging("info", "json")
    # The server loop runs inside C and never returns to Python: Ctrl-C must end the process
    # the way SIGTERM does, not wait for a KeyboardInterrupt that cannot be raised.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    from worker.llm.devices import cpu_device, start_rpc_server  # noqa: PLC0415

    host = f"[{args.host}]" if ":" in args.host and not args.host.startswith("[") else args.host
    endpoint = f"{host}:{args.port}"
    if not _is_loopback(args.host):
        log.warning("rpc_device.exposed", endpoint=endpoint,
                    reason="llama.cpp's RPC protocol has no authentication")
    device = cpu_device()
    log.info("rpc_device.serving", endpoint=endpoint, device=device.name, threads=args.threads,
             cache=args.cache)
    start_rpc_server(endpoint, [device], args.threads, args.cache)
    # Only a server that could not start returns (llama.cpp printed why, e.g. the port).
    log.error("rpc_device.stopped", endpoint=endpoint)
    return 1


if __name__ == "__main__":
    sys.exit(main())
