"""A Redis client that changes the data between two of a reader's round trips, to test reads that must not tear."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class MovesMidway:
    """Wraps a client; runs `move` once, just before its round trip number `before` (a command or a pipeline run)."""

    def __init__(self, client: Any, move: Callable[[], None], before: int) -> None:
        self._client = client
        self._move = move
        self._left = before

    def tick(self) -> None:
        """Count one round trip, making the move first when its turn has come."""
        if self._left == 0:
            self._move()
        self._left -= 1

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._client, name)
        if name == "pipeline":
            return lambda *args, **kwargs: _Pipeline(attribute(*args, **kwargs), self.tick)
        if not callable(attribute):
            return attribute

        def round_trip(*args: Any, **kwargs: Any) -> Any:
            self.tick()
            return attribute(*args, **kwargs)

        return round_trip


class _Pipeline:
    """A pipeline whose `execute` is one round trip of its `MovesMidway` client."""

    def __init__(self, pipeline: Any, tick: Callable[[], None]) -> None:
        self._pipeline = pipeline
        self._tick = tick

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipeline, name)

    def __len__(self) -> int:
        return len(self._pipeline)

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        self._tick()
        return self._pipeline.execute(*args, **kwargs)
