"""DirectCalls: commands past redis-py's pool on a stack of connections of its own, on a real Redis."""

from __future__ import annotations

import os
import threading

import pytest
import redis
from django.conf import settings
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError, ResponseError
from redis.retry import Retry

from bench.private_redis import free_port
from tasks_app.protocol.scripts import SPARE_MAX, DirectCalls, connect
from tests.support.broker_calls import ids, make_task, push


@pytest.fixture
def direct(key_prefix: str) -> DirectCalls:
    calls = DirectCalls.of(connect(settings.REDIS_URL))
    assert calls is not None
    return calls


def test_a_call_returns_its_reply_and_an_error_reply_raises_and_leaves_the_connection_usable(direct, key_prefix):
    key = f"{key_prefix}:n"
    assert direct.call("SET", key, "abc") == b"OK"  # the reply as parsed, no response callback
    with pytest.raises(ResponseError, match="not an integer"):
        direct.call("INCR", key)
    assert direct.call("GET", key) == b"abc"
    assert direct.call("CLIENT", "ID") == direct.call("CLIENT", "ID")  # one connection, given back each time


def test_threads_calling_at_once_never_share_a_connection(direct, key_prefix):
    key, replies = f"{key_prefix}:count", []

    def count() -> None:
        replies.extend(direct.call("INCR", key) for _ in range(300))

    threads = [threading.Thread(target=count) for _ in range(SPARE_MAX + 4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(replies) == list(range(1, 300 * len(threads) + 1))  # no reply read by the wrong caller


def test_a_connection_the_server_closed_while_idle_is_opened_again_before_the_call(direct):
    first = direct.call("CLIENT", "ID")
    connect(settings.REDIS_URL).client_kill_filter(_id=first)
    assert direct.call("PING") == b"PONG"  # not a failed call: the pool's check, before sending
    assert direct.call("CLIENT", "ID") != first


def test_a_call_that_cannot_connect_raises_and_keeps_nothing(key_prefix):
    direct = DirectCalls.of(connect(f"redis://127.0.0.1:{free_port()}/0"))
    assert direct is not None
    for _ in range(2):
        with pytest.raises(RedisConnectionError):
            direct.call("PING")
    assert len(direct._spare) == 0


def test_clients_that_re_send_or_route_by_slot_keep_their_own_path():
    assert DirectCalls.of(redis.Redis(retry=Retry(NoBackoff(), 2))) is None
    assert DirectCalls.of(object()) is None


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded")  # the child only calls Redis and exits
def test_a_forked_child_opens_connections_of_its_own(direct):
    parent_connection = direct.call("CLIENT", "ID")
    child = os.fork()
    if child == 0:  # pragma: no cover (the child's result is its exit status)
        os._exit(0 if direct.call("CLIENT", "ID") != parent_connection else 1)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert direct.call("CLIENT", "ID") == parent_connection  # the parent's is still whole


def test_a_single_enqueue_survives_a_closed_connection_and_a_flushed_script_cache(broker):
    push(broker, make_task(1))  # announces the queue: the next ones take the one-script path
    direct = broker.enqueuer.redis.direct
    assert direct is not None
    broker.client.client_kill_filter(_id=direct.call("CLIENT", "ID"))
    push(broker, make_task(2))
    broker.client.script_flush()
    push(broker, make_task(3))  # loaded by source
    assert ids(broker.client.lrange(broker.keys.pending("q"), 0, -1)) == ["task-3", "task-2", "task-1"]
