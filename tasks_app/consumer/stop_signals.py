"""SIGTERM and SIGINT for a consumer: the first asks for a graceful stop, a second one exits at once."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from types import FrameType

# The consumer's own logger: these lines were always the consumer's.
logger = logging.getLogger("tasks_app.consumer.lifecycle")

# Ctrl-C reaches the whole process group, and supervisors pass it on too: a signal this soon is the same request.
SIGNAL_ECHO_S = 1.0


def install_stop_signals(request_stop: Callable[[], None], grace_s: float) -> None:
    """SIGTERM/SIGINT: call `request_stop` once; a signal SIGNAL_ECHO_S or more after the first exits at once."""
    first_signal_at: list[float] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if not first_signal_at:
            first_signal_at.append(now)
            logger.info("signal %d: finishing in-flight tasks (grace %gs); send again to exit now", signum, grace_s)
            request_stop()
        elif now - first_signal_at[0] >= SIGNAL_ECHO_S:
            logger.warning("second signal: exiting now; the lease will recover what was held")
            os._exit(1)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
