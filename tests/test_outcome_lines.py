"""Outcome lines: written in order by their own thread, all of them once closed, one failing line stops none."""

import logging
import threading

from tasks_app.consumer.ack_batcher import OutcomeLines


def test_lines_are_written_in_the_order_given_and_all_of_them_by_close():
    written: list[int] = []
    lines = OutcomeLines()
    lines.start()
    for batch in range(50):
        lines.add([lambda n=n: written.append(n) for n in range(batch * 10, batch * 10 + 10)])
    lines.close(timeout_s=10)
    assert written == list(range(500))


def test_lines_are_written_by_a_thread_of_their_own_once_started():
    threads: list[str] = []
    lines = OutcomeLines()
    lines.add([lambda: threads.append(threading.current_thread().name)])  # not started: at once, here
    lines.start()
    lines.add([lambda: threads.append(threading.current_thread().name)])
    lines.close(timeout_s=10)
    assert threads == [threading.current_thread().name, "outcome-lines"]


def test_a_line_that_raises_stops_no_other(caplog):
    written: list[str] = []

    def broken() -> None:
        raise RuntimeError("a formatter's bug")

    lines = OutcomeLines()
    lines.start()
    with caplog.at_level(logging.ERROR, logger="tasks_app.consumer.ack_batcher"):
        lines.add([lambda: written.append("a"), broken, lambda: written.append("b")])
        lines.add([lambda: written.append("c")])
        lines.close(timeout_s=10)
    assert written == ["a", "b", "c"]
    assert "unexpected error logging a task's outcome" in caplog.text
