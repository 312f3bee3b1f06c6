"""Encoding of the protobuf task envelope and its JSON payload (the only user of task_pb2), and JSON text."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError

from tasks_app.task_pb2 import Task as Task

# Deeper arguments are refused at enqueue; deeper values read from Redis are shown as text.
MAX_JSON_DEPTH = 64

# Built once: `json.dumps` with options builds an encoder per call.
_COMPACT_ENCODERS = {
    (ensure_ascii, allow_nan): json.JSONEncoder(separators=(",", ":"), ensure_ascii=ensure_ascii, allow_nan=allow_nan)
    for ensure_ascii in (False, True)
    for allow_nan in (False, True)
}


def compact_json(value: Any, *, ensure_ascii: bool = False, allow_nan: bool = True) -> str:
    """Return `value` as JSON text without spaces, as payloads and result records store it."""
    return _COMPACT_ENCODERS[ensure_ascii, allow_nan].encode(value)


class JsonTooDeep(ValueError):
    """JSON text nested deeper than allowed."""


def _containers(value: Any, kinds: tuple[type, ...]) -> Iterator[tuple[Any, int]]:
    """Yield `value` and each container of `kinds` in it with its nesting level (`value`: 1), without recursion."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, level = stack.pop()
        yield item, level
        children = item.values() if isinstance(item, dict) else item
        stack += [(child, level + 1) for child in children if isinstance(child, kinds)]


def depth(value: Any) -> int:
    """Return how deeply parsed JSON `value` nests lists and dicts (a scalar is 0)."""
    if not isinstance(value, (list, dict)):
        return 0
    return max(level for _, level in _containers(value, (list, dict)))


def argument_problem(
    value: Sequence[Any] | dict[str, Any], text: str = "", max_depth: int = MAX_JSON_DEPTH
) -> str | None:
    """Say why JSON-encodable `value` would not reach a handler as given (too deep, a key not a string), or None."""
    if not value:
        return None
    if text and text.count("{") <= isinstance(value, dict) and text.count("[") + text.count("{") <= max_depth:
        return None  # its JSON `text` rules both out
    # JSON writes the keys 1 and True as "1" and "true": the handler would get other keys, or lose a value.
    for item, level in _containers(value, (list, tuple, dict)):
        if level > max_depth:
            return f"arguments may nest at most {max_depth} levels"
        for key in item if isinstance(item, dict) else ():
            if not isinstance(key, str):
                return f"object keys must be strings, got {key!r}"
    return None


def loads_bounded(text: str | bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse JSON text; raise ValueError if it is invalid, JsonTooDeep if it nests over `max_depth`."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise JsonTooDeep(f"JSON is nested too deeply (at most {max_depth} levels)") from None
    if depth(value) > max_depth:
        raise JsonTooDeep(f"JSON is nested too deeply (at most {max_depth} levels)")
    return value


def is_utf8_encodable(text: str) -> bool:
    """True unless `text` holds a lone surrogate (what "surrogateescape" decoding leaves)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _mapped(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """A parsed JSON value with `leaf` applied to each scalar and each key."""
    if isinstance(value, list):
        return [_mapped(item, leaf) for item in value]
    if isinstance(value, dict):
        return {leaf(key): _mapped(item, leaf) for key, item in value.items()}
    return leaf(value)


def scrub_text(value: Any) -> Any:
    """Return a parsed JSON value whose strings carry no lone surrogate (written as escapes instead)."""
    return _mapped(
        value, lambda item: item.encode("utf-8", "backslashreplace").decode() if isinstance(item, str) else item
    )


def finite(value: Any) -> Any:
    """Return a parsed JSON value with NaN and infinities as None: strict JSON has neither (JSON.stringify's way)."""
    return _mapped(value, lambda item: None if isinstance(item, float) and not math.isfinite(item) else item)


PRIORITY_MIN = -100
PRIORITY_MAX = 100


class UndecodableTask(ValueError):
    """Bytes that are not a valid task envelope or carry an invalid payload."""


@dataclass(slots=True)  # not frozen: one per run, and frozen costs four times as much to build
class Arguments:
    """The positional and keyword arguments of a task."""

    args: list[Any]
    kwargs: dict[str, Any]


def encode_arguments(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[str, str]:
    """The compact JSON texts of `args` and `kwargs`, "" for each that is empty (NaN refused)."""
    return (
        compact_json(list(args), allow_nan=False) if args else "",
        compact_json(dict(kwargs), allow_nan=False) if kwargs else "",
    )


def payload_of(args_json: str, kwargs_json: str) -> bytes:
    """The UTF-8 JSON payload of texts from `encode_arguments` (UnicodeEncodeError for a lone surrogate)."""
    members = []
    if args_json:
        members.append(f'"args":{args_json}')
    if kwargs_json:
        members.append(f'"kwargs":{kwargs_json}')
    return f"{{{','.join(members)}}}".encode()


def decode_payload(payload: bytes) -> Arguments:
    """Parse a payload into arguments, raising UndecodableTask when it is malformed."""
    if not payload:
        return Arguments([], {})
    try:
        body = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise UndecodableTask(f"payload is not UTF-8 JSON: {exc}") from None
    except RecursionError:
        raise UndecodableTask("payload is nested too deeply to be parsed") from None
    if not isinstance(body, dict):
        raise UndecodableTask('payload must be a JSON object {"args": [...], "kwargs": {...}}')
    args = body.get("args", [])
    kwargs = body.get("kwargs", {})
    if not isinstance(args, list):
        raise UndecodableTask('payload "args" must be a JSON array')
    if not isinstance(kwargs, dict):
        raise UndecodableTask('payload "kwargs" must be a JSON object')
    return Arguments(args, kwargs)


def encode_task(task: Task) -> bytes:
    """Serialize a task envelope (unknown fields read earlier are kept)."""
    return task.SerializeToString()


def decode_task(raw: bytes) -> Task:
    """Parse a task envelope, raising UndecodableTask for bytes that are not one; clamp its priority."""
    task = Task()
    try:
        task.ParseFromString(raw)
    except DecodeError as exc:
        raise UndecodableTask(f"not a scheduler.v1.Task protobuf: {exc}") from None
    if not task.id or not task.type:
        raise UndecodableTask("task envelope has no id or no type")
    # A foreign producer may send any int32; the delayed-set member holds exactly 4 characters.
    task.priority = min(PRIORITY_MAX, max(PRIORITY_MIN, task.priority))
    return task
