"""An idle consumer costs Redis a few commands a second, yet starts a task at once and stops at once."""

import signal
import time
from pathlib import Path

import pytest

from tasks_app import producer
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.scripts import connect
from tests.chaos.servers import RedisServer
from tests.support.processes import wait_until
from tests.support.recording import recorded_runs

pytestmark = pytest.mark.django_db(transaction=True)  # commands are counted on a private server: load skews nothing

# What an idle consumer may cost Redis, scripts' inner commands included (about 2.3 a second here).
IDLE_COMMANDS_PER_S = 3.0
# Two of its heartbeats and reaper looks (every 10 s) and up to one full claim (once a lease): about 45 commands.
WINDOW_S = 20.0
# Within it a stop has cut the consumer's blocking claim short: uncut, it lasts up to LONGEST_WAIT_S.
STOP_CUTS_WAIT_S = 2.0


def blocked_moves(client) -> list[dict]:
    """The clients blocked in a BLMOVE."""
    return [entry for entry in client.client_list() if entry["cmd"] == "blmove" and "b" in entry["flags"]]


def commands_run(client) -> int:
    """Commands Redis has run, scripts' inner calls included."""
    return sum(int(entry["calls"]) for entry in client.info("commandstats").values())


def test_an_idle_consumer_on_one_queue_costs_at_most_three_commands_a_second(
    tmp_path: Path, key_prefix, consumer_process
):
    # Before: a blocking claim of 2 s and its fencing script, back to back, made 5.4 commands a second.
    server = RedisServer(tmp_path).start()
    try:
        client = connect(server.url)
        private = Broker(client, key_prefix)
        consumer = consumer_process("--concurrency", "4", REDIS_URL=server.url)
        wait_until(lambda: private.inspect.queue_stats("default").consumers, 60, message=consumer.log)
        time.sleep(3)  # every loop past its first pass
        before = commands_run(client)
        time.sleep(WINDOW_S)
        rate = (commands_run(client) - before - 1) / WINDOW_S  # less the measuring INFO
        assert rate <= IDLE_COMMANDS_PER_S, f"{rate:.2f} commands a second"

        # Its long wait still hands it a task at once, and a stop cuts that wait short (before: it ran out).
        producer.enqueue("test.record", broker=private)
        wait_until(lambda: recorded_runs(private), 5, message=consumer.log)
        wait_until(lambda: blocked_moves(client), 10, message="the consumer to wait again")
        consumer.signal(signal.SIGTERM)
        wait_until(lambda: not blocked_moves(client), STOP_CUTS_WAIT_S, message=consumer.log)
        assert consumer.wait(60) == 0, consumer.log()
    finally:
        server.remove()
