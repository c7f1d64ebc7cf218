"""Real RPC device processes for the device-group tests (``coordinator.rpc_local``).

Each device is a separate process on a free loopback port, serving this host's CPU as
llama.cpp's RPC backend does for a remote GPU: a worker over them splits its model across
separate buffers in separate processes. A device serves one client at a time and a client
keeps its connection for its whole life, so a test process that loads models over devices
itself (in-process) needs devices of its own, apart from those its subprocesses use.
"""

from __future__ import annotations

import pytest

from coordinator.rpc_local import local_rpc_devices as rpc_devices  # noqa: F401  (re-exported)
from worker.llm.devices import rpc_supported

#: Every test of a device group needs the RPC backend in the installed llama.cpp.
needs_rpc = pytest.mark.skipif(
    not rpc_supported(),
    reason="this llama-cpp-python was built without the RPC backend (make install builds it "
           "with CMAKE_ARGS=-DGGML_RPC=ON)")
