"""API tokens for tests: a row and its secret, as the admin mints them."""

from typing import Any

from tasks_app.models import ApiToken


def issue_token(user: Any, name: str) -> tuple[ApiToken, str]:
    """Create a token for `user`; return the row and the secret."""
    row = ApiToken(user=user, name=name)
    secret = row.new_secret()
    row.save()
    return row, secret
