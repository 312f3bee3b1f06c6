"""With Redis unreachable every staff page and JSON view answers 503 saying so, never a server error."""

import pytest
from django.test import Client

pytestmark = pytest.mark.django_db

AWAY = "redis://127.0.0.1:1/0"  # nothing listens there: each connection is refused at once

PAGES = ["/tasks/", "/tasks/?status=FAILED&q=ab", "/tasks/dashboard/", "/tasks/abc/", "/tasks/dashboard/q/dead/"]
JSON_VIEWS = ["/tasks/?format=json", "/tasks/dashboard/series.json", "/api/tasks/abc/", "/api/queues/q/"]
POSTS = [
    ("/tasks/", {"action": "cancel", "task": "abc"}),
    ("/tasks/dashboard/q/pause/", {"action": "pause"}),
    ("/tasks/abc/cancel/", {}),
    ("/tasks/dashboard/q/dead/", {"action": "delete", "ref": "1:" + "0" * 40}),
]


@pytest.fixture
def redis_away(settings) -> None:
    settings.REDIS_URL = AWAY


@pytest.fixture
def staff_away(staff: Client, redis_away: None) -> Client:
    staff.raise_request_exception = False  # a view's error is answered as a 500, as in production
    return staff


@pytest.mark.parametrize("url", PAGES)
def test_a_page_says_redis_is_unreachable_with_a_503(staff_away, url):
    response = staff_away.get(url)
    assert response.status_code == 503
    assert response["Retry-After"] == "5"
    assert "Redis is unreachable" in response.content.decode()
    assert 'id="redis-away"' in response.content.decode()


@pytest.mark.parametrize("url", JSON_VIEWS)
def test_a_json_view_answers_a_json_503(staff_away, url):
    response = staff_away.get(url)
    assert response.status_code == 503
    assert response["Retry-After"] == "5"
    assert response.json()["error"].startswith("Redis is unreachable")


@pytest.mark.parametrize(("url", "data"), POSTS)
def test_an_action_posted_while_redis_is_away_answers_503(staff_away, url, data):
    assert staff_away.post(url, data).status_code == 503


@pytest.mark.parametrize("url", [*PAGES, "/tasks/dashboard/series.json"])
def test_anonymous_users_are_still_sent_to_the_login_not_told_about_redis(client, redis_away, url):
    response = client.get(url)
    assert response.status_code == 302
    assert "/login/" in response["Location"]
