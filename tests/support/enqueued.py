"""What an enqueue leaves in Redis: for tests that claim a rejected request enqueued nothing, or that all was run."""

from __future__ import annotations

from collections.abc import Sequence

from tasks_app.protocol.broker import Broker


def enqueued_keys(broker: Broker) -> list[bytes]:
    """Every key of this test's prefix that an enqueue writes, on any queue: none after a refusal.

    The queue set alone is not enough: a producer that announced a queue lately does not add it
    again for a minute, and a READY record or a delayed member can be written without it.
    """
    keys = broker.keys
    patterns = [keys.queues(), keys.pending("*"), keys.prioritized("*"), keys.delayed("*"), keys.result("*")]
    return sorted(key for pattern in patterns for key in broker.client.scan_iter(match=pattern, count=1000))


def is_idle(broker: Broker, queues: Sequence[str]) -> bool:
    """True when none of `queues` has anything pending, in flight or delayed."""
    for queue in queues:
        stats = broker.inspect.queue_stats(queue)
        if stats.pending or stats.processing or stats.delayed:
            return False
    return True
