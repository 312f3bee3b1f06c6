"""A consumer's identity: what it registers under its id, and never running beside another live holder of it.

A fixed `--consumer-id` restarted at once, or child `<id>-<n>` of a supervisor restarted while an
orphan of the previous one still finishes its runs under that id, must not run beside that live
holder (one could reap, return or ack the other's tasks). The lease entry names its holder (host,
pid, pid namespace): a holder of this host whose process is gone (killed, crashed) is dead now, and
the new run recovers its list at once; one still running, or on another host (which cannot be
asked), is waited for until it deregisters or its lease lapses (then it is presumed dead).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tasks_app.consumer.loops import ReaperLoop, raise_key_errors
from tasks_app.consumer.options import ConsumerOptions
from tasks_app.consumer.retrying import GaveUp, until_done
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.replies import LeaseHolder

logger = logging.getLogger(__name__)

# How often a consumer waiting for its id looks again whether the holder let go.
HOLDER_RECHECK_S = 0.25


def pid_namespace() -> str:
    """This process's pid namespace ("" where /proc does not say): pids compare only within one."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def default_consumer_id() -> str:
    """`<host>-<pid>-<6 hex>`, the host's name cut to the characters an id may hold (reapers skip any other id)."""
    host = re.sub(r"[^A-Za-z0-9_.:-]", "-", socket.gethostname())[:120] or "host"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def process_info(options: ConsumerOptions, prefetch_max: int, instance: str) -> dict[str, Any]:
    """What a consumer registers beside its lease: who it is (`instance`: its renewals' token), and how it runs."""
    return {
        "instance": instance,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pid_ns": pid_namespace(),
        "started_at_ms": int(time.time() * 1000),
        "lease_ms": int(options.lease_s * 1000),
        "concurrency": options.concurrency,
        "prefetch": prefetch_max,
        "queues": options.queues,
    }


def recover_earlier_run(reaper: ReaperLoop, queue: str, consumer_id: str) -> None:
    """Recover what an earlier run under `consumer_id` left on `queue` (it did not exit cleanly)."""
    recovered = reaper.reap(queue, consumer_id, own_earlier_run=True)
    if recovered:
        logger.warning(
            "recovered %d task(s) left by an earlier run of %s on %s, which did not exit cleanly",
            recovered,
            consumer_id,
            queue,
        )


def deregister_everywhere(broker: Broker, queues: Sequence[str], consumer_id: str, instance: str) -> None:
    """Leave every queue cleanly, where this run (`instance`) still holds `consumer_id`; elsewhere the lease expires."""
    for queue in queues:
        try:
            if broker.deregister(queue, consumer_id, instance) < 0:
                logger.warning("consumer id %s on %s is another process's now: left to it", consumer_id, queue)
        except Exception as exc:
            logger.error("could not deregister from %s (the lease will expire): %s", queue, exc)


def holder_is_gone(info: dict[str, Any]) -> bool:
    """True if the holder registered from this host and pid namespace and its process no longer runs."""
    pid = info.get("pid")
    if info.get("host") != socket.gethostname() or info.get("pid_ns", "") != pid_namespace():
        return False
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    if pid == os.getpid():
        return True  # an earlier process that had this pid (a restarted container): it is not running now
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: past the platform's pids, no process has it
        return True
    except OSError:  # another user's process: alive
        return False
    return _is_zombie(pid)  # killed, but not yet reaped by its parent


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def live_holders(broker: Broker, queues: Sequence[str], consumer_id: str) -> list[LeaseHolder]:
    """The lease entries of `consumer_id` that another process may still hold: fresh, and not known dead."""
    holders, errors = broker.lease_holders(queues, consumer_id)
    raise_key_errors(errors, "reading the lease entries")
    return [holder for holder in holders if holder.ms_left > 0 and not holder_is_gone(holder.info)]


def wait_until_free(
    broker: Broker, queues: Sequence[str], consumer_id: str, stop: threading.Event, reached: Callable[[], None]
) -> None:
    """Wait while another live process holds `consumer_id` on any of `queues`; raise GaveUp if `stop` is set.

    `reached` is called at each answer from Redis: a consumer waiting for its id is alive (its health file stays fresh).
    """
    waited = False
    while held := until_done(lambda: live_holders(broker, queues, consumer_id), what="register", give_up=stop):
        reached()
        if not waited:
            holder = held[0]
            logger.warning(
                "consumer id %s is held by a live process (pid %s on %s) with %.1f s of lease left on queue %s: "
                "waiting until it exits or its lease lapses",
                consumer_id,
                holder.info.get("pid", "?"),
                holder.info.get("host", "?"),
                holder.ms_left / 1000,
                holder.queue,
            )
            waited = True
        if stop.wait(HOLDER_RECHECK_S):
            raise GaveUp
    if waited:
        logger.warning("consumer id %s is free: starting", consumer_id)
