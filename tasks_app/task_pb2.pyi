from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class Task(_message.Message):
    __slots__ = ("id", "type", "payload", "queue", "priority", "attempt", "max_attempts", "enqueued_at_ms", "run_after_ms", "headers", "last_error", "last_traceback", "dead_reason", "unique_digest")
    class HeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    MAX_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    ENQUEUED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    RUN_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    LAST_TRACEBACK_FIELD_NUMBER: _ClassVar[int]
    DEAD_REASON_FIELD_NUMBER: _ClassVar[int]
    UNIQUE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    id: str
    type: str
    payload: bytes
    queue: str
    priority: int
    attempt: int
    max_attempts: int
    enqueued_at_ms: int
    run_after_ms: int
    headers: _containers.ScalarMap[str, str]
    last_error: str
    last_traceback: str
    dead_reason: str
    unique_digest: str
    def __init__(self, id: _Optional[str] = ..., type: _Optional[str] = ..., payload: _Optional[bytes] = ..., queue: _Optional[str] = ..., priority: _Optional[int] = ..., attempt: _Optional[int] = ..., max_attempts: _Optional[int] = ..., enqueued_at_ms: _Optional[int] = ..., run_after_ms: _Optional[int] = ..., headers: _Optional[_Mapping[str, str]] = ..., last_error: _Optional[str] = ..., last_traceback: _Optional[str] = ..., dead_reason: _Optional[str] = ..., unique_digest: _Optional[str] = ...) -> None: ...
