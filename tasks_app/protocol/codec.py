"""Encoding of the protobuf task envelope and its JSON payload; the only user of task_pb2."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError

from tasks_app.protocol.jsontext import compact_json
from tasks_app.task_pb2 import Task as Task

PRIORITY_MIN = -100
PRIORITY_MAX = 100


class UndecodableTask(ValueError):
    """Bytes that are not a valid task envelope or carry an invalid payload."""


@dataclass(slots=True)  # not frozen: one per run, and frozen costs four times as much to build
class Arguments:
    """The positional and keyword arguments of a task."""

    args: list[Any]
    kwargs: dict[str, Any]


def encode_payload(args: Sequence[Any], kwargs: Mapping[str, Any]) -> bytes:
    """Serialize arguments into the UTF-8 JSON payload."""
    return payload_of(*encode_arguments(args, kwargs))


def encode_arguments(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[str, str]:
    """The compact JSON texts of `args` and `kwargs`, "" for each that is empty (NaN refused)."""
    return (
        compact_json(list(args), allow_nan=False) if args else "",
        compact_json(dict(kwargs), allow_nan=False) if kwargs else "",
    )


def payload_of(args_json: str, kwargs_json: str) -> bytes:
    """The UTF-8 JSON payload {"args": ..., "kwargs": ...} of texts from `encode_arguments`.

    Raises UnicodeEncodeError for a text holding a lone surrogate.
    """
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
