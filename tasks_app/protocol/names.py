"""Validation of queue and task type names, so that no name can break a Redis key."""

import re

NAME_PATTERN = re.compile(r"[A-Za-z0-9_.:-]{1,100}")
NAME_RULE = "1-100 characters from A-Z, a-z, 0-9 and _ . : -"


class InvalidName(ValueError):
    """A queue or task type name that breaks the naming rule."""


def validate_name(value: str, what: str = "name") -> str:
    """Return `value` if it is a valid queue or type name, else raise InvalidName."""
    if not isinstance(value, str) or not NAME_PATTERN.fullmatch(value):
        raise InvalidName(f"invalid {what} {value!r}: use {NAME_RULE}")
    return value
