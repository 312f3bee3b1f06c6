"""Template helpers for text read from Redis: shown on one line and bounded, linked only when it makes a URL."""

from __future__ import annotations

from typing import Any

from django import template
from django.urls import NoReverseMatch, reverse

from tasks_app.logging import escape_control

register = template.Library()

# Longer text is cut (with an ellipsis) where a page shows a name or an id.
DISPLAY_CHARS = 200
# Longer ids are shown but not linked: such a URL would only bloat the page.
MAX_LINKED_CHARS = 1000


@register.filter
def printable(value: Any, limit: int = DISPLAY_CHARS) -> str:
    """Return `value` as text with control characters escaped, cut to `limit` characters."""
    text = escape_control(str(value))
    return text if len(text) <= limit else text[: limit - 1] + "…"


@register.simple_tag
def url_or_empty(view_name: str, *args: Any) -> str:
    """Return the URL of `view_name` for `args`, or "" when they cannot make one (e.g. an id with "/")."""
    if any(not isinstance(arg, str) or len(arg) > MAX_LINKED_CHARS for arg in args):
        return ""
    try:
        return reverse(view_name, args=args)
    except NoReverseMatch:
        return ""
