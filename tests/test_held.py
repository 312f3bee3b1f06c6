"""The tasks a consumer holds: their slots come back as they finish, or all at once at the end of a `together` block."""

import threading

from tasks_app.consumer.claiming import Capacity, Claimed, HeldTasks


def _held(count: int) -> tuple[HeldTasks, Capacity, list[Claimed]]:
    capacity = Capacity(concurrency=count, prefetch=0)
    claimed = [Claimed("q", "c", f"task {n}".encode()) for n in range(count)]
    for _ in claimed:
        assert capacity.acquire(timeout_s=0)
    held = HeldTasks(capacity)
    held.took(claimed)
    return held, capacity, claimed


def test_finished_tasks_give_their_slots_back_at_once():
    held, capacity, claimed = _held(3)
    held.finished(claimed[:1])
    assert capacity.in_use == 2
    assert held.raws("q", "c") == {b"task 1": 1, b"task 2": 1}


def test_the_slots_of_tasks_finished_together_come_back_when_the_block_ends():
    held, capacity, claimed = _held(3)
    with held.together():
        held.finished(claimed[:1])
        with held.together():  # nested: the outer block gives them back
            held.finished(claimed[1:2])
        assert capacity.in_use == 3
        assert held.raws("q", "c") == {b"task 2": 1}  # no longer held, though the slots are not back yet
    assert capacity.in_use == 1


def test_a_together_block_on_one_thread_holds_back_no_other_threads_slots():
    held, capacity, claimed = _held(2)
    with held.together():
        other = threading.Thread(target=held.finished, args=(claimed[1:],))
        other.start()
        other.join()
        assert capacity.in_use == 1
        held.finished(claimed[:1])
    assert capacity.in_use == 0


def test_the_slots_come_back_even_when_the_block_fails():
    held, capacity, claimed = _held(2)
    try:
        with held.together():
            held.finished(claimed)
            raise RuntimeError("a callback's bug")
    except RuntimeError:
        pass
    assert capacity.in_use == 0
