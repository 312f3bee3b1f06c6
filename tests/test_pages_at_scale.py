"""Staff pages over big Redis state: what one request reads and answers stays bounded."""

import json

import pytest
from django.urls import reverse

pytestmark = pytest.mark.django_db

MB = 1024 * 1024


def test_a_task_page_of_huge_values_is_cut_with_a_note(staff, broker):
    huge = "x" * (5 * MB)
    errors = [{"exception_class_path": "builtins.ValueError", "traceback": f"{i}"} for i in range(10_000)]
    errors[-1]["traceback"] = "Traceback (most recent call last):\n" + "y" * MB + "\nValueError: last"
    broker.client.hset(
        broker.keys.result("big"),
        mapping={
            "id": "big",
            "type": "demo.echo",
            "queue": "q",
            "status": "FAILED",
            "args": json.dumps([huge]),
            "kwargs": json.dumps({"k": huge}),
            "return_value": json.dumps(huge),
            "errors": json.dumps(errors),
        },
    )
    response = staff.get(reverse("tasks_app:task", args=["big"]))
    assert response.status_code == 200
    html = response.content.decode()
    assert len(html) < 400_000
    assert html.count("Shown cut:") == 4  # args, kwargs, return value, traceback
    assert "10000 failed attempts in all" in html
    assert "ValueError: last" in html  # a traceback's end, where the exception is, is kept
