"""`Broker`, the only code that talks to Redis: the protocol's roles over one client, keys and scripts."""

from __future__ import annotations

from typing import Any

from tasks_app.protocol.enqueue import AnnouncedQueues, Enqueuer
from tasks_app.protocol.history import CLUSTER_WAIT_MS, HISTORY_MAX, INDEX_TTL_S, Control, Records
from tasks_app.protocol.inspection import Inspection
from tasks_app.protocol.keys import Keys
from tasks_app.protocol.leases import Leases
from tasks_app.protocol.limits import Limits
from tasks_app.protocol.periodic import Periodic
from tasks_app.protocol.queue import Queue
from tasks_app.protocol.scripts import ScriptClient, Scripts, connect
from tasks_app.protocol.workflows import Workflows


class Broker:
    """The roles of the protocol, sharing one client, its keys and the scripts."""

    def __init__(
        self,
        client: Any,
        prefix: str,
        scripts: Scripts | None = None,
        *,
        cluster_wait_ms: int = CLUSTER_WAIT_MS,
        history_max: int = HISTORY_MAX,
        history_ttl_s: int = INDEX_TTL_S,
    ) -> None:
        self.client = client
        self.keys = Keys(prefix)
        self.scripts = scripts or Scripts()
        redis = ScriptClient(client, self.keys, self.scripts)
        self.records = Records(redis, cluster_wait_ms, history_max, history_ttl_s)
        self.queue = Queue(redis, self.records)
        self.enqueuer = Enqueuer(redis, AnnouncedQueues(), history_max)
        self.leases = Leases(redis)
        self.limits = Limits(redis)
        self.control = Control(redis)
        self.periodic = Periodic(redis, self.enqueuer)
        self.inspect = Inspection(redis, self.queue, self.records)
        self.workflows = Workflows(redis, self.queue)

    def __copy__(self) -> Broker:
        """A broker on the same client and scripts with roles of its own (another consumer's instance token)."""
        return self.over(self.client)

    def over(self, client: Any) -> Broker:
        """A broker on `client` (a connection of its own) with these keys, scripts and settings."""
        return Broker(
            client,
            self.keys.prefix,
            self.scripts,
            cluster_wait_ms=self.records.cluster_wait_ms,
            history_max=self.records.history_max,
            history_ttl_s=self.records.history_ttl_s,
        )

    @classmethod
    def from_settings(cls, *, prefix: str | None = None, timeout_s: float = 15.0, resend: bool = True) -> Broker:
        """Build a broker, with a connection pool of its own, from Django settings (see `connect`)."""
        from django.conf import settings

        client = connect(settings.REDIS_URL, settings.REDIS_CLUSTER, timeout_s=timeout_s, resend=resend)
        return cls(
            client,
            prefix or settings.TASKS_KEY_PREFIX,
            cluster_wait_ms=settings.TASKS_CLUSTER_WAIT_MS,
            history_max=settings.TASKS_HISTORY_MAX,
            history_ttl_s=settings.TASKS_RESULT_TTL,
        )


_brokers: dict[tuple[str, bool, str], Broker] = {}


def get_broker() -> Broker:
    """Return the process-wide broker for the current settings (created on first use)."""
    from django.conf import settings

    key = (settings.REDIS_URL, settings.REDIS_CLUSTER, settings.TASKS_KEY_PREFIX)
    broker = _brokers.get(key)
    if broker is None:
        broker = _brokers.setdefault(key, Broker.from_settings())
    return broker
