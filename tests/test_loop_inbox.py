"""LoopInbox: calls handed to an event loop from other threads, in order, one wake-up per batch, none lost."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator

import pytest

from tasks_app.consumer.async_lane import LoopInbox


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def on_loop(loop: asyncio.AbstractEventLoop, callback) -> None:
    """Run `callback` on the loop and wait until it ran."""
    done = threading.Event()
    loop.call_soon_threadsafe(lambda: (callback(), done.set()))
    assert done.wait(5)


def test_calls_put_while_the_loop_is_busy_are_made_in_order_after_one_wake_up(loop, monkeypatch):
    inbox, made, wakes = LoopInbox(loop), [], []
    schedule = loop.call_soon_threadsafe
    monkeypatch.setattr(loop, "call_soon_threadsafe", lambda *a: (wakes.append(a), schedule(*a))[1])
    release = threading.Event()
    schedule(release.wait)  # the loop is busy until released
    assert all(inbox.put(made.append, n) for n in range(100))
    assert len(wakes) == 1  # one drain scheduled for the hundred
    release.set()
    on_loop(loop, lambda: None)
    assert made == list(range(100))


def test_threads_putting_at_once_lose_no_call(loop):
    inbox, made = LoopInbox(loop), []

    def put_many(first: int) -> None:
        for n in range(first, first + 2000):
            inbox.put(made.append, n)

    threads = [threading.Thread(target=put_many, args=(k * 2000,)) for k in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    on_loop(loop, lambda: None)  # a drain scheduled before this call has run
    for _ in range(3):  # and any drain the last puts scheduled after it
        on_loop(loop, lambda: None)
    assert sorted(made) == list(range(12000))
    assert [n for n in made if n < 2000] == list(range(2000))  # one thread's calls keep their order


def test_a_raising_call_is_logged_and_the_calls_after_it_are_still_made(loop, caplog):
    inbox, made = LoopInbox(loop), []
    release = threading.Event()
    loop.call_soon_threadsafe(release.wait)
    inbox.put(made.append, 1)
    inbox.put(lambda: 1 / 0)
    inbox.put(made.append, 2)
    with caplog.at_level(logging.ERROR, logger="tasks_app.consumer.async_lane"):
        release.set()
        on_loop(loop, lambda: None)
    assert made == [1, 2]
    assert "a callback handed to the asyncio lane's event loop raised" in caplog.text


def test_a_closed_loop_takes_no_call():
    loop = asyncio.new_event_loop()
    loop.close()
    assert LoopInbox(loop).put(print, "never") is False
