"""API tokens: issue them (the secret is returned once), and authenticate `Authorization: Bearer` requests."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Any

from django.http import HttpRequest
from django.utils import timezone

from tasks_app.models import ApiToken

TOKEN_BYTES = 32


class AuthenticationFailed(Exception):
    """A request with credentials that do not identify an active user."""


def hash_token(token: str) -> str:
    """Return the SHA-256 hex digest under which a token is stored."""
    return hashlib.sha256(token.encode()).hexdigest()


def issue_token(user: Any, name: str) -> tuple[ApiToken, str]:
    """Create a token for `user`; return the row and the secret, which is stored only as a hash."""
    row = ApiToken(user=user, name=name)
    secret = fill_new_token(row)
    row.save()
    return row, secret


def fill_new_token(row: ApiToken) -> str:
    """Give an unsaved token row a fresh secret; return the secret."""
    secret = secrets.token_urlsafe(TOKEN_BYTES)
    row.key_hash = hash_token(secret)
    row.key_prefix = secret[:8]
    return secret


@dataclass(frozen=True)
class Credentials:
    """Who made an API request, and whether by token (CSRF-exempt) or by session."""

    user: Any
    by_token: bool


def bearer_token(request: HttpRequest) -> str | None:
    """Return the token of an `Authorization: Bearer` header, "" if malformed, None if absent."""
    header = request.headers.get("Authorization")
    if header is None:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return ""
    return token.strip()


def authenticate(request: HttpRequest) -> Credentials | None:
    """Identify the caller by bearer token, else by session; None for an anonymous caller."""
    token = bearer_token(request)
    if token is None:
        user = getattr(request, "user", None)
        return Credentials(user, by_token=False) if user is not None and user.is_authenticated else None
    if not token:
        raise AuthenticationFailed("malformed Authorization header: expected 'Bearer <token>'")
    row = ApiToken.objects.select_related("user").filter(key_hash=hash_token(token)).first()
    if row is None:
        raise AuthenticationFailed("invalid API token")
    if not row.is_active:
        raise AuthenticationFailed("API token revoked")
    if not row.user.is_active:
        raise AuthenticationFailed("the token's user is inactive")
    ApiToken.objects.filter(pk=row.pk).update(last_used_at=timezone.now())
    return Credentials(row.user, by_token=True)
