"""Log formatting: text lines with control characters escaped, or one JSON object per line (LOG_FORMAT=json)."""

import json
import logging
import re
from datetime import UTC, datetime

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
    return _CONTROL.sub(_escape, text)


class TextFormatter(logging.Formatter):
    """The text format: a record's message (whatever task ids or errors it holds) stays on one line.

    A traceback or stack follows on lines of its own, indented and escaped, so no line of it
    can pass for a record.
    """

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
