"""The dashboard's charts: per-minute series of the last hour read from the counters, and drawn as inline SVG."""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from django.template.loader import render_to_string
from django.utils.safestring import SafeString

from tasks_app.protocol.broker import Broker
from tasks_app.protocol.history import DURATION_BUCKETS_MS, OUTCOMES
from tasks_app.templatetags.tasks_display import printable

WINDOW_MINUTES = 60
# Types drawn one chart each, busiest first; the others are in the table only.
MAX_TYPE_CHARTS = 8

Series = dict[str, list[float | None]]


def percentile_ms(buckets: Mapping[int, int], share: float) -> float | None:
    """The duration under which `share` of the runs fell, interpolated within its bucket; None without runs."""
    buckets = {index: count for index, count in buckets.items() if count > 0}  # a count taken back to 0: none
    total = sum(buckets.values())
    if not total:
        return None
    wanted, seen = share * total, 0
    for index in sorted(buckets):
        count = buckets[index]
        if seen + count >= wanted:
            if index >= len(DURATION_BUCKETS_MS):  # the open-ended last bucket (or one a newer version added)
                return DURATION_BUCKETS_MS[-1]
            lower = DURATION_BUCKETS_MS[index - 1] if index > 0 else 0.0
            return lower + (DURATION_BUCKETS_MS[index] - lower) * (wanted - seen) / count
        seen += count
    return None


def _type_json(series: Series, minute_buckets: list[Counter[int]]) -> dict[str, Any]:
    """A type's outcome series with its p50/p95 per minute, and the hour's totals."""
    hour_buckets: Counter[int] = Counter()
    for buckets in minute_buckets:
        hour_buckets.update(buckets)  # not `+`, which would drop a negative count midway
    return {
        **series,
        "p50_ms": [percentile_ms(buckets, 0.5) for buckets in minute_buckets],
        "p95_ms": [percentile_ms(buckets, 0.95) for buckets in minute_buckets],
        "hour_p50_ms": percentile_ms(hour_buckets, 0.5),
        "hour_p95_ms": percentile_ms(hour_buckets, 0.95),
        "hour_total": sum(v or 0 for kind in OUTCOMES for v in series[kind]),
    }


def chart_data(broker: Broker, queues: Sequence[str], now_s: float | None = None) -> dict[str, Any]:
    """The last hour per minute: per queue outcomes and backlog, per type outcomes and p50/p95 durations."""
    current = int(now_s if now_s is not None else time.time()) // 60
    minutes = list(range(current - WINDOW_MINUTES + 1, current + 1))
    by_queue: dict[str, Series] = {}
    # Per type, summed over queues: its outcome series and each minute's duration histogram.
    series: defaultdict[str, Series] = defaultdict(lambda: {name: [0] * WINDOW_MINUTES for name in OUTCOMES})
    buckets: defaultdict[str, list[Counter[int]]] = defaultdict(lambda: [Counter() for _ in range(WINDOW_MINUTES)])
    for queue in queues:
        rows = broker.inspect.minute_counts(queue, minutes)
        by_queue[queue] = {name: [row.get(name, 0) for row in rows] for name in OUTCOMES}
        by_queue[queue]["backlog"] = [row.get("backlog") for row in rows]
        for index, row in enumerate(rows):
            for field, amount in row.items():
                kind, _, rest = field.partition("|")
                task_type, _, bucket = rest.rpartition("|")
                if kind == "d" and bucket.isdecimal() and len(bucket) <= 3:  # int() takes no "²", nor 5,000 digits
                    buckets[task_type][index][int(bucket)] += amount
                elif kind in OUTCOMES and rest:
                    series[rest][kind][index] = (series[rest][kind][index] or 0) + amount
    types = {name: _type_json(series[name], buckets[name]) for name in sorted(series.keys() | buckets.keys())}
    return {"minutes": [minute * 60 for minute in minutes], "queues": by_queue, "types": types}


# Each line's colour, as the admin's palette has them (success, error, warning, info), and its label.
LINES = {
    "ok": ("#2e7d32", "succeeded"),
    "failed": ("#c62828", "failed"),
    "retried": ("#ef6c00", "retried"),
    "backlog": ("#1565c0", "backlog"),
    "p50_ms": ("#1565c0", "p50"),
    "p95_ms": ("#8e24aa", "p95"),
}

WIDTH, HEIGHT, LEFT, BOTTOM, TOP = 360, 120, 44, 18, 8
FRAME = {"width": WIDTH, "height": HEIGHT, "left": LEFT, "top": TOP, "bottom": HEIGHT - BOTTOM}


def _label(value: float, unit: str) -> str:
    if unit == "ms" and value >= 1000:
        return f"{value / 1000:.3g} s"
    return f"{value:.3g}{' ms' if unit == 'ms' else ''}"


def svg_chart(title: str, series: Series, unit: str = "") -> SafeString:
    """A small line chart of per-minute series (None = no data) over the last hour, as inline SVG."""
    values = [v for points in series.values() for v in points if v is not None]
    top = max(values, default=0) or 1
    plot_w, plot_h = WIDTH - LEFT - 4, HEIGHT - BOTTOM - TOP
    marks = []  # a run of points as a line; a lone one (between gaps) as a dot: a line of one point shows nothing
    for name, points in series.items():
        step = plot_w / max(1, len(points) - 1)
        for run in _runs(points):
            xy = [(LEFT + i * step, TOP + plot_h - (value / top) * plot_h) for i, value in run]
            marks.append((LINES[name][0], [(f"{x:.1f}", f"{y:.1f}") for x, y in xy]))
    context = {"frame": FRAME, "title": title, "top_label": _label(top, unit), "marks": marks}
    return render_to_string("tasks_app/_chart.html", {**context, "legend": [LINES[name] for name in series]})


def _runs(points: Sequence[float | None]) -> list[list[tuple[int, float]]]:
    """Split a series at its gaps (None), so a line is not drawn across minutes without data."""
    runs: list[list[tuple[int, float]]] = [[]]
    for index, value in enumerate(points):
        if value is None:
            if runs[-1]:
                runs.append([])
        else:
            runs[-1].append((index, value))
    return [run for run in runs if run]


def dashboard_charts(data: dict[str, Any]) -> dict[str, Any]:
    """The SVG charts of `chart_data` for the dashboard: per queue and per (busiest) type."""
    queues = [
        {
            "name": name,
            "outcomes": svg_chart(f"{printable(name)}: tasks per minute", {k: series[k] for k in OUTCOMES}),
            "backlog": svg_chart(f"{printable(name)}: backlog", {"backlog": series["backlog"]}),
        }
        for name, series in data["queues"].items()
    ]
    busiest = sorted(data["types"].items(), key=lambda item: -item[1]["hour_total"])
    types = [
        {"name": name, **{total: series[total] for total in ("hour_total", "hour_p50_ms", "hour_p95_ms")}}
        for name, series in busiest
    ]
    for row, (name, series) in zip(types[:MAX_TYPE_CHARTS], busiest, strict=False):  # the busiest drawn
        row["outcomes"] = svg_chart(f"{printable(name)}: tasks per minute", {k: series[k] for k in OUTCOMES})
        row["durations"] = svg_chart(f"{printable(name)}: duration", {k: series[k] for k in ("p50_ms", "p95_ms")}, "ms")
    return {"queue_charts": queues, "type_charts": types}
