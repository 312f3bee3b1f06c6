"""Template helpers: Redis text on one line and bounded, linked only when it makes a URL; times and durations."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django import template
from django.urls import NoReverseMatch, Resolver404, resolve, reverse
from django.utils.html import format_html

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
        url = reverse(view_name, args=args)
    except NoReverseMatch:
        return ""
    try:  # an id such as "dashboard" or ".." makes a URL of another page
        names_it = resolve(url).view_name == view_name
    except Resolver404:
        names_it = False
    return url if names_it else ""


@register.filter
def when(moment: datetime | None) -> str:
    """Show a time with seconds and its age ("12:34:56 12 s ago"), the full timestamp (µs, UTC) on hover."""
    if moment is None:
        return "—"
    utc = moment.astimezone(UTC)
    today = abs((datetime.now(UTC) - moment).total_seconds()) < 20 * 3600
    return format_html(
        '<time datetime="{}" title="{}" data-age>{} <span class="tasks-age">{}</span></time>',
        moment.isoformat(),
        utc.strftime("%Y-%m-%d %H:%M:%S.%f UTC"),
        utc.strftime("%H:%M:%S" if today else "%Y-%m-%d %H:%M:%S"),
        age(moment),
    )


def age(moment: datetime, now: datetime | None = None) -> str:
    """How long ago (or from now) `moment` is, in its largest unit: "12 s ago", "3 min ago", "in 2 h"."""
    seconds = ((now or datetime.now(UTC)) - moment).total_seconds()
    size = abs(seconds)
    for unit, width in (("d", 86400), ("h", 3600), ("min", 60)):
        if size >= width:
            amount = f"{int(size // width)} {unit}"
            break
    else:
        amount = f"{int(size)} s"
    return f"{amount} ago" if seconds >= 0 else f"in {amount}"


@register.filter
def seconds(value: float | None) -> str:
    """A duration in seconds as people read it: "850 ms", "3.2 s", "2 min 5 s"."""
    if value is None:
        return "—"
    if value < 1:
        return f"{value * 1000:.0f} ms"
    if value < 60:
        return f"{value:.1f} s"
    return f"{int(value // 60)} min {int(value % 60)} s"
