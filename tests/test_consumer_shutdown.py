"""A consumer's graceful stop: its grace period, and the runs still going when it ends."""

from __future__ import annotations

import threading

import pytest

from tests.support.processes import wait_until
from tests.test_consumer import make_consumer

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_grace_period_counts_from_the_stop_even_while_a_claimer_is_slow_to_stop(broker, caplog):
    # Before: the stop waited for its claimers (up to block_s + 1 s each) and only then began
    # the grace period: a stop took that much longer than --grace.
    consumer = make_consumer(broker, grace_s=0.3, block_s=30)
    claimer_may_stop = threading.Event()
    slow_claimer = threading.Thread(target=claimer_may_stop.wait, args=(30,), daemon=True)
    slow_claimer.start()
    consumer._claimers = [slow_claimer]
    consumer._busy = 1  # a run that does not end
    stopping = threading.Thread(target=consumer.shutdown, daemon=True)
    stopping.start()
    try:
        wait_until(lambda: "grace period over" in caplog.text, 10, message="the grace period to end")
        assert stopping.is_alive(), "it still waits for its claimer before it leaves"
    finally:
        claimer_may_stop.set()
    stopping.join(10)
    assert not stopping.is_alive() and broker.live_consumers("q") == []
