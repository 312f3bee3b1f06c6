"""The admin's static files are served without DEBUG (under gunicorn), not only by runserver."""


def test_admin_css_is_served_with_debug_off(client, settings):
    settings.DEBUG = False
    response = client.get("/static/admin/css/base.css")
    assert response.status_code == 200
    assert b"".join(response.streaming_content if response.streaming else [response.content])
