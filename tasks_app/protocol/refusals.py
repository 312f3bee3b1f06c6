"""Redis refusing a key for what it holds (a foreign writer's key of another type): naming the key in the
error, and reading queue by queue past such refusals, so that one queue's bad key is that queue's problem only."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from redis.exceptions import ResponseError

from tasks_app.protocol.scripts import is_transient


class KeyRefused(ResponseError):
    """Redis refused to read a key for what it holds (a foreign writer's key of another type): retrying cannot help."""


def refused(exc: BaseException) -> bool:
    """Whether Redis refused a request for what it asked (a key of another type), not for being away or busy."""
    return isinstance(exc, ResponseError) and not is_transient(exc)


def as_refusal(key: str, exc: Exception) -> Exception:
    """`exc` as KeyRefused naming `key` (none: a script's error names it) if Redis refused that key for what it holds.

    Any other error as is.
    """
    if not refused(exc):
        return exc
    return KeyRefused(f"{key}: {exc}" if key else str(exc))


@contextlib.contextmanager
def naming(key: str = "") -> Iterator[None]:
    """Raise Redis's refusal of `key` for what it holds as KeyRefused naming it (see `as_refusal`); others as is."""
    try:
        yield
    except ResponseError as exc:
        if refused(exc):
            raise as_refusal(key, exc) from exc
        raise


def read_each[T](queues: Iterable[str], read: Callable[[str], T]) -> tuple[dict[str, T], dict[str, str]]:
    """`read` of each queue, and the error of each queue whose keys Redis refused to read (a foreign key's type).

    An error that passes (Redis away, loading, failing over) is raised: it is no one queue's.
    """
    found: dict[str, T] = {}
    unreadable: dict[str, str] = {}
    for queue in queues:
        try:
            found[queue] = read(queue)
        except ResponseError as exc:
            if not refused(exc):
                raise
            unreadable[queue] = str(exc)
    return found, unreadable


def replies_by_queue(queues: Sequence[str], replies: Sequence[Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Each queue's reply (one per queue, in order), and the error of each queue whose keys Redis refused.

    An error that passes (Redis away, loading, failing over) is raised: it is no one queue's.
    """
    found: dict[str, Any] = {}
    unreadable: dict[str, str] = {}
    for queue, reply in zip(queues, replies, strict=True):
        if not isinstance(reply, Exception):
            found[queue] = reply
        elif refused(reply):
            unreadable[queue] = str(reply)
        else:
            raise reply
    return found, unreadable
