"""The worker as rq and the fleet see it: rq's worker record and command channel, the
context tiers it takes from, and the checks that its name and its devices are free.

These adapt the process to rq and the registry; the serving loop (``loop.py``) never needs
them to step a job, and ``runner.py`` wires them around it.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

from redis import Redis
from rq.command import parse_payload
from rq.queue import Queue
from rq.serializers import JSONSerializer
from rq.worker import SimpleWorker, WorkerStatus

from shared.keys import Keys
from shared.logs import get_logger
from shared.registry import FleetRegistry
from shared.replies import text
from worker.launch import exclusive_devices
from worker.service.channels import ChannelListener

log = get_logger("worker")


class ContextTiers:
    """The context tiers of a model this worker serves: every tier up to its own per-slot
    context, and its own queues (jobs routed to ``worker`` for the prefixes it holds).
    Registering adds its own to the model's tier set; :meth:`queues` reads the set again
    (each heartbeat), so a tier that appears later is served from then on."""

    def __init__(self, connection: Redis, keys: Keys, model: str, n_ctx: int,
                 worker: str) -> None:
        self._conn = connection
        self._keys = keys
        self._model = model
        self._n_ctx = n_ctx
        self._worker = worker
        connection.zadd(keys.tiers(model), {str(n_ctx): n_ctx})

    def queues(self) -> list[str]:
        """The queue names to take from, in order (``Keys.queues``)."""
        tiers = [int(text(t)) for t in self._conn.zrangebyscore(self._keys.tiers(self._model),
                                                                0, self._n_ctx)]
        return self._keys.queues(self._model, tiers, self._worker)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check_name_free(registry: FleetRegistry, name: str) -> None:
    """Refuse a name a live worker holds; a dead holder on this host is taken over at once.

    After ``kill -9`` the registration lives on until its TTL: when it names this host and a
    pid that no longer exists, its holder is certainly gone, so the new process proceeds (its
    registration overwrites the old one and it requeues what the old one held)."""
    holder = registry.registration(name)
    if holder is None:
        return
    if holder.host == socket.gethostname() and holder.pid != os.getpid() \
            and not _pid_alive(holder.pid):
        log.warning("worker.takeover", worker=name, previous_pid=holder.pid,
                    previous_job=holder.current_job)
        return
    raise RuntimeError(f"a live worker is already registered as {name!r} "
                       f"(pid {holder.pid} on {holder.host})")


class RqPresence(SimpleWorker):
    """rq's record of this worker (``rq info`` lists it, busy or idle) and its command
    channel, so rq's own tools still reach it: ``shutdown`` stops the loop gracefully (as a
    first SIGTERM) and ``stop-job`` cancels that job. rq never runs a job here."""

    def __init__(self, queues: list[Queue], name: str, connection: Redis,
                 on_shutdown: Callable[[], None], on_stop_job: Callable[[str], None]) -> None:
        super().__init__(queues, name=name, connection=connection, serializer=JSONSerializer)
        self._on_shutdown = on_shutdown
        self._on_stop_job = on_stop_job
        self._commands: ChannelListener | None = None

    def subscribe(self) -> None:
        """Listen on rq's command channel with a :class:`ChannelListener`, not rq's own
        ``run_in_thread`` one, whose unsubscribe closes the connection from this thread
        while the listener may still read it (``channels.py``)."""
        self._commands = ChannelListener(self.connection, "rq-commands", self.handle_payload,
                                         channels=[self.pubsub_channel_name])

    def unsubscribe(self) -> None:
        """Stop the command listener (it closes its own connection)."""
        if self._commands is not None:
            self._commands.close()
            self._commands = None

    def handle_payload(self, message: dict[str, object]) -> None:
        payload = parse_payload(message)
        command = payload.get("command")
        log.info("worker.rq_command", worker=self.name, command=command,
                 job_id=payload.get("job_id"))
        if command == "shutdown":
            self._on_shutdown()
        elif command == "stop-job" and payload.get("job_id"):
            self._on_stop_job(str(payload["job_id"]))

    @classmethod
    def start(cls, connection: Redis, name: str, queues: list[Queue],
              on_shutdown: Callable[[], None],
              on_stop_job: Callable[[str], None]) -> RqPresence:
        """Register with rq (retiring a record a previous process under this name left) and
        listen on rq's command channel."""
        stale = SimpleWorker.find_by_key(f"rq:worker:{name}", connection=connection,
                                         serializer=JSONSerializer)
        if stale is not None:
            stale.register_death()
        presence = cls(queues, name, connection, on_shutdown, on_stop_job)
        presence.register_birth()
        presence.set_state(WorkerStatus.IDLE)
        presence.subscribe()
        return presence

    def stop(self) -> None:
        """Leave rq's registry and its command channel."""
        self.unsubscribe()
        self.register_death()


def check_devices_free(registry: FleetRegistry, device: str, name: str) -> None:
    """Refuse a device group that overlaps a live worker's (its GPUs on this host, its RPC
    servers anywhere), naming that worker: two workers on one GPU each fit the model to the
    memory the other then takes. A holder whose process is gone from this host does not
    count (it is being taken over, as in :func:`check_name_free`)."""
    host = socket.gethostname()
    mine = exclusive_devices(device, host)
    if not mine:
        return
    for other in registry.live_workers():
        if other.name == name or (other.host == host and not _pid_alive(other.pid)):
            continue
        shared = sorted(mine & exclusive_devices(other.device, other.host))
        if shared:
            raise RuntimeError(f"{', '.join(shared)} already serve(s) worker {other.name!r} "
                               f"(pid {other.pid} on {other.host}): a device serves one "
                               "worker; pick another --device / --rpc, or stop that worker")

