"""Log formatting: text lines with control characters escaped, or one JSON object per line (LOG_FORMAT=json)."""

import contextlib
import json
import logging
import re
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

# Attributes every LogRecord has; anything else was passed in `extra` and is emitted as a field.
_STANDARD_ATTRIBUTES = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}
# C0 and C1 control characters, DEL, the Unicode line and paragraph separators, and lone surrogates
# (which no UTF-8 stream or page can carry).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# Every line after a record's first (traceback, stack) starts with this, so no line it holds looks like a record.
CONTINUATION_INDENT = "    "


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    return _NAMED.get(char) or (f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}")


def escape_control(text: str) -> str:
    """Return `text` with every control character written as a backslash escape (one line)."""
    # str.isprintable() refuses every character the pattern matches: most lines are checked in C and kept.
    return text if text.isprintable() else _CONTROL.sub(_escape, text)


class TextFormatter(logging.Formatter):
    """The text format: a record's message (whatever task ids or errors it holds) stays on one line."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._second: tuple[int, str | None, str] | None = None  # the last second formatted, as (second, datefmt, text)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        """The record's time as logging.Formatter writes it; the text of a second is made once."""
        second = int(record.created)
        cached = self._second
        if cached is None or cached[0] != second or cached[1] != datefmt:
            moment = self.converter(record.created)
            cached = (second, datefmt, time.strftime(datefmt or self.default_time_format, moment))
            self._second = cached
        if datefmt or not self.default_msec_format:
            return cached[2]
        return self.default_msec_format % (cached[2], record.msecs)

    def format(self, record: logging.LogRecord) -> str:
        record.message = record.getMessage()
        if self.usesTime():
            record.asctime = self.formatTime(record, self.datefmt)
        lines = [escape_control(self.formatMessage(record))]
        if record.exc_info:
            lines.append(self._indented(self.formatException(record.exc_info)))
        elif record.exc_text:
            lines.append(self._indented(record.exc_text))
        if record.stack_info:
            lines.append(self._indented(self.formatStack(record.stack_info)))
        return "\n".join(lines)

    @staticmethod
    def _indented(text: str) -> str:
        return "\n".join(CONTINUATION_INDENT + escape_control(line) for line in text.splitlines())


class JsonFormatter(logging.Formatter):
    """Format records as JSON lines carrying the `extra` fields (task_id, type, queue, ...)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, tz=UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRIBUTES and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


_held = threading.local()  # the lines a thread holds back (held_lines), by handler


class ConsoleHandler(logging.StreamHandler):
    """A StreamHandler whose lines, while their thread holds them (`held_lines`), go out in one write."""

    def emit(self, record: logging.LogRecord) -> None:
        held: dict[ConsoleHandler, list[str]] | None = getattr(_held, "lines", None)
        if held is None:
            super().emit(record)
            return
        try:
            held.setdefault(self, []).append(self.format(record) + self.terminator)
        except Exception:
            self.handleError(record)

    def write_lines(self, lines: list[str]) -> None:
        """Write `lines` (each ending with the terminator) with one write and one flush."""
        with self.lock or contextlib.nullcontext():
            try:
                self.stream.write("".join(lines))
                self.flush()
            except Exception:
                logging.Handler.handleError(self, logging.makeLogRecord({"msg": f"{len(lines)} log lines"}))


@contextlib.contextmanager
def held_lines() -> Iterator[None]:
    """Hold back the lines this thread logs to console handlers until the block ends, then write them at once."""
    if getattr(_held, "lines", None) is not None:  # nested: the outer block writes them
        yield
        return
    _held.lines = {}
    try:
        yield
    finally:
        held, _held.lines = _held.lines, None
        for handler, lines in held.items():
            handler.write_lines(lines)
