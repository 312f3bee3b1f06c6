"""What a consumer holds: the tasks it claimed and has not let go of, and its one suspect turn."""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator, Sequence

from tasks_app import metrics
from tasks_app.consumer.capacity import Capacity
from tasks_app.consumer.claimed import Claimed


class HeldTasks:
    """Claimed tasks not yet let go of, counted per processing list (twins can be claimed at once).

    A task leaves through `finished`, which gives back its room in the consumer (and the suspect turn,
    if it was the suspect). At most one suspect (a task recovered from a consumer that died) is held
    at a time, so a death can be pinned on it.
    """

    def __init__(self, capacity: Capacity) -> None:
        self.capacity = capacity
        self._counts: Counter[tuple[str, str, bytes]] = Counter()  # (queue, consumer id, task)
        self._lock = threading.Lock()
        self._suspect_reserved = False
        self._suspect_lock = threading.Lock()
        self._together = threading.local()  # room of tasks a thread finishes in a `together` block

    @contextlib.contextmanager
    def together(self) -> Iterator[None]:
        """Give back the room of the tasks this thread finishes in the block at once, when it ends.

        The ack batcher finishes a flush's tasks in one: its claimer then takes their slots in one
        claim, instead of a claim for each task as its room frees.
        """
        if getattr(self._together, "room", None) is not None:  # nested: the outer block gives them back
            yield
            return
        self._together.room = 0
        try:
            yield
        finally:
            room, self._together.room = self._together.room, None
            self._give_back(room)

    def took(self, claimed: Sequence[Claimed]) -> None:
        """Count tasks just claimed (their room in the consumer was taken by the claim)."""
        metrics.IN_FLIGHT.inc(len(claimed))
        with self._lock:
            self._counts.update((item.queue, item.consumer_id, item.raw) for item in claimed)

    def finished(self, claimed: Sequence[Claimed]) -> None:
        """Give back the room of tasks that left this consumer's hands."""
        if any(item.suspect for item in claimed):
            self.give_suspect_turn_back()
        with self._lock:
            for item in claimed:
                key = (item.queue, item.consumer_id, item.raw)
                self._counts[key] -= 1
                if self._counts[key] <= 0:
                    del self._counts[key]
        together = getattr(self._together, "room", None)
        if together is not None:
            self._together.room = together + len(claimed)
        else:
            self._give_back(len(claimed))

    def _give_back(self, tasks: int) -> None:
        if tasks:
            metrics.IN_FLIGHT.dec(tasks)
            self.capacity.release(tasks)

    def raws(self, queue: str, consumer_id: str) -> Counter[bytes]:
        """The tasks of one processing list held, each with how many times."""
        with self._lock:
            return Counter({raw: n for (q, c, raw), n in self._counts.items() if q == queue and c == consumer_id})

    def take_suspect_turn(self) -> bool:
        """Take the turn to hold a suspect; False if it is taken."""
        with self._suspect_lock:
            if self._suspect_reserved:
                return False
            self._suspect_reserved = True
            return True

    def give_suspect_turn_back(self) -> None:
        """Give the turn to hold a suspect back."""
        with self._suspect_lock:
            self._suspect_reserved = False
