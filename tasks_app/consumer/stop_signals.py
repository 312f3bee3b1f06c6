"""Stop signals for a consumer: SIGTERM, SIGINT and SIGHUP ask for a graceful stop, SIGQUIT exits at once.

As in Celery and gunicorn: SIGTERM (and Ctrl-C's SIGINT) is a graceful stop and a second one
exits at once; SIGQUIT (Ctrl-\\) is that second signal at once. SIGHUP (its terminal closed) stops
gracefully too, unless it was ignored when the process started (`nohup`): then it stays ignored.

A child of `runconsumer --processes` gets the same request twice, by two routes: Ctrl-C (or
systemd) signals every process of the group, and its supervisor passes the signal on, as late as
its load makes it. So a supervised child never exits at once on a later signal: only its
supervisor, on a second signal to itself, decides that (and kills it).
"""

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


def graceful_signals() -> list[signal.Signals]:
    """The signals that ask for a graceful stop: SIGTERM, SIGINT, and SIGHUP unless ignored from the start."""
    hangup = [] if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else [signal.SIGHUP]
    return [signal.SIGTERM, signal.SIGINT, *hangup]


def install_stop_signals(request_stop: Callable[[], None], grace_s: float, *, supervised: bool = False) -> None:
    """Graceful signals call `request_stop` once; one SIGNAL_ECHO_S later exits now, unless `supervised`; SIGQUIT
    exits now (its supervisor passes on SIGTERM only, so a child's SIGQUIT is always meant)."""
    first_signal_at: list[float] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if not first_signal_at:
            first_signal_at.append(now)
            again = "a second signal to the supervisor kills it" if supervised else "send again to exit now"
            logger.info("signal %d: finishing in-flight tasks (grace %gs); %s", signum, grace_s, again)
            request_stop()
        elif not supervised and now - first_signal_at[0] >= SIGNAL_ECHO_S:
            logger.warning("second signal: exiting now; the lease will recover what was held")
            os._exit(1)

    def on_quit(signum: int, frame: FrameType | None) -> None:
        logger.warning("signal %d (SIGQUIT): exiting now; the lease will recover what was held", signum)
        os._exit(1)

    for signum in graceful_signals():
        signal.signal(signum, on_signal)
    signal.signal(signal.SIGQUIT, on_quit)
