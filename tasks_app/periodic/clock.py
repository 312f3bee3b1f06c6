"""When a schedule is saved, on the clock its slots are decided on: the Redis server's."""

from __future__ import annotations

import logging
from datetime import datetime

from django.utils import timezone

from tasks_app.protocol.records import datetime_of_ms

logger = logging.getLogger(__name__)


def saved_now() -> datetime:
    """The Redis server's now, to stamp a saved schedule with; this host's clock if Redis does not answer."""
    from tasks_app.protocol.broker import get_broker  # the broker's settings are read at call time

    try:
        moment = datetime_of_ms(get_broker().inspect.server_time_ms())
    except Exception as exc:  # Redis away: the save goes on, on this host's clock
        logger.warning("periodic task saved on this host's clock, Redis did not answer: %r", exc)
        return timezone.now()
    return moment or timezone.now()
