"""The scheduler of periodic tasks that every consumer runs: no beat process, each slot fired once by a script."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Sequence

from django.conf import settings
from django.db import close_old_connections
from redis.exceptions import RedisError

from tasks_app import metrics
from tasks_app.consumer.options import ConsumerOptions
from tasks_app.periodic.code import sync_code_schedules
from tasks_app.periodic.config import PeriodicConfig, load_configs
from tasks_app.periodic.firing import fire_slot
from tasks_app.periodic.problems import ScheduleProblems
from tasks_app.periodic.schedule import Schedule
from tasks_app.problem_log import ProblemLog
from tasks_app.producer import EnqueueError, TaskTypeDisabled
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.periodic import FireReply, SlotFiring
from tasks_app.protocol.scripts import is_transient
from tasks_app.registry import Registry, registry as default_registry

logger = logging.getLogger(__name__)

MIN_SLEEP_S = 0.005
# A slot the script found still ahead (the server clock stepped back) is tried again no sooner than this.
EARLY_RETRY_MS = 100


class PeriodicLoop:
    """Fires the due slot of every enabled schedule, sleeping until the nearest next slot; syncs TASKS_PERIODIC."""

    name = "periodic"

    def __init__(
        self,
        broker: Broker,
        refresh_s: float,
        grace_s: float,
        *,
        load: Callable[[], Sequence[PeriodicConfig]] | None = None,
        clock_ms: Callable[[], int] | None = None,
        registry: Registry = default_registry,
    ) -> None:
        self.broker = broker
        self.refresh_s = refresh_s
        self.grace_ms = int(grace_s * 1000)
        self._problems = ScheduleProblems(logger)  # what is wrong with each schedule, said once
        self._reload_problem: ProblemLog[str] = ProblemLog(logger)
        self._synced = False
        self._load = load or functools.partial(load_configs, problems=self._problems)
        # Slots are computed on the Redis server's clock, the one the fire script decides on.
        self._clock_ms = clock_ms or broker.inspect.server_time_ms
        self._registry = registry
        self._configs: Sequence[PeriodicConfig] = ()
        self._next_load = float("-inf")
        # Per schedule, the last slot handled and the last one fired, as Redis last told.
        self._handled: dict[str, int] = {}
        self._fired: dict[str, int] = {}
        # Per schedule it could not fire, the first slot failed since: lateness counts from it if none fired.
        self._failing_since: dict[str, int] = {}
        # Per schedule, when to look at it again: a pass computes slots only for the schedules due.
        self._next_look: dict[str, tuple[Schedule, int]] = {}
        # Per schedule, the slot after the lateness gauges' reference slot, keyed by schedule and reference.
        self._following: dict[str, tuple[tuple[Schedule, int], int | None]] = {}

    def run_once(self) -> float:
        """Fire what is due; return the seconds until the nearest next slot, at most the refresh period."""
        if not self._synced:
            try:
                sync_code_schedules(settings.TASKS_PERIODIC, self._registry)
                self._synced = True
                self._reload_problem.recovered("sync", "TASKS_PERIODIC synced to the database")
            except Exception as exc:  # the database may be away: fire the schedules it has, sync later
                message = "cannot sync TASKS_PERIODIC to the database yet: %s"
                self._reload_problem.failed("sync", repr(exc), message, exc)
            finally:
                close_old_connections()
        if time.monotonic() >= self._next_load:
            self._reload()
        if not self._configs:
            return max(MIN_SLEEP_S, self._next_load - time.monotonic())  # no schedule: no need of the server's clock
        now_ms, read_at = self._clock_ms(), time.monotonic()
        wake_ms = now_ms + int(self.refresh_s * 1000)
        for config in self._configs:
            # The server's now as the pass goes on: a long pass must not fire a slot newer ones followed.
            at_ms = now_ms + int((time.monotonic() - read_at) * 1000)
            try:
                wake_ms = min(wake_ms, self._look(config, at_ms))
            except RedisError:
                raise  # the loop's runner backs off
            except Exception as exc:  # one schedule's bug must not starve the others
                message = "periodic task %s: unexpected error (said again only if this changes)"
                self._problems.failed(
                    config.name, "error", config.saved_ms, repr(exc), message, config.name, exc_info=True
                )
            else:
                self._problems.resolved(config.name, "error")
        return max(MIN_SLEEP_S, (wake_ms - now_ms) / 1000 - (time.monotonic() - read_at))

    def _reload(self) -> None:
        try:
            configs = self._load()
        except Exception as exc:  # the database may be briefly away: keep firing the last schedules
            message = "cannot reload periodic tasks, keeping the last ones: %s"
            self._reload_problem.failed("reload", repr(exc), message, exc)
            configs = self._configs
        else:
            self._reload_problem.recovered("reload", "periodic tasks reloaded again")
        finally:
            close_old_connections()
        self._next_load = time.monotonic() + self.refresh_s
        for gone in {c.name for c in self._configs} - {c.name for c in configs}:
            for gauge in (metrics.PERIODIC_LATE, metrics.PERIODIC_PERIOD):
                with contextlib.suppress(KeyError):
                    gauge.remove(gone)
            for remembered in (self._failing_since, self._next_look, self._following):
                remembered.pop(gone, None)
        self._configs = configs

    def _look(self, config: PeriodicConfig, now_ms: int) -> int:
        """Fire `config`'s due slot if it is time to look at it and the slot is not handled; when to look again."""
        look = self._next_look.get(config.name)
        if look is None or look[0] != config.schedule or look[1] <= now_ms:
            due_ms = config.schedule.latest_at_or_before(now_ms)
            retry_at_ms = None
            if due_ms is not None and due_ms > self._handled.get(config.name, -1):
                retry_at_ms = self._fire(config, due_ms, now_ms)
            if retry_at_ms is None:
                next_ms = config.schedule.next_after(now_ms)
                retry_at_ms = next_ms if next_ms is not None else now_ms + int(self.refresh_s * 1000)
            look = self._next_look[config.name] = (config.schedule, retry_at_ms)
        self._report_lateness(config, now_ms)
        return look[1]

    def _fire(self, config: PeriodicConfig, slot_ms: int, now_ms: int) -> int | None:
        """Run the fire script for one slot; return when to try again if it was early on the server's clock."""
        schedule = config.schedule
        following_ms = schedule.next_after(slot_ms)
        previous_ms = schedule.previous_before(slot_ms)
        period_ms = following_ms - slot_ms if following_ms is not None else self.grace_ms
        on_time_ms = min(self.grace_ms, period_ms)
        firing = SlotFiring(slot_ms, previous_ms or 0, on_time_ms, config.catch_up, config.saved_ms)
        try:
            reply = self._fire_or_skip(config, firing)
        except (EnqueueError, RedisError) as exc:
            if isinstance(exc, RedisError) and is_transient(exc):
                raise  # Redis away or busy: the loop's runner backs off
            # Not retried by this consumer: the next slot tries again; the other schedules go on.
            message = "periodic task %s: slot %d not fired (said again only if this changes): %s"
            self._problems.failed(config.name, "firing", config.saved_ms, str(exc), message, config.name, slot_ms, exc)
            self._handled[config.name] = slot_ms
            self._failing_since.setdefault(config.name, slot_ms)
            return None
        finally:
            close_old_connections()
        if reply.outcome == "early":  # the server's clock stepped back since it was read
            return now_ms + max(EARLY_RETRY_MS, slot_ms - reply.now_ms)
        self._handled[config.name] = reply.handled_slot_ms
        self._fired[config.name] = reply.fired_slot_ms
        self._failing_since.pop(config.name, None)
        if reply.pushed:
            metrics.PERIODIC_FIRED.labels(config.name).inc(2 if reply.outcome == "fired_and_caught_up" else 1)
            logger.info("periodic task %s: %s slot %d", config.name, reply.outcome, reply.handled_slot_ms)
        return None

    def _fire_or_skip(self, config: PeriodicConfig, firing: SlotFiring) -> FireReply:
        """Fire the slot; if its task type is disabled, record it as skipped: refused, so never caught up."""
        try:
            reply = fire_slot(config, firing, self.broker, registry=self._registry)
        except TaskTypeDisabled as exc:
            message = "periodic task %s: slot %d skipped (said again only if this changes): %s"
            self._problems.failed(
                config.name,
                "firing",
                config.saved_ms,
                str(exc),
                message,
                config.name,
                firing.slot_ms,
                exc,
                level=logging.INFO,
            )
            return self.broker.periodic.skip_periodic(config.target_queue or exc.queue, config.name, firing.slot_ms)
        self._problems.resolved(config.name, "firing")
        return reply

    def _report_lateness(self, config: PeriodicConfig, now_ms: int) -> None:
        """Set the gauges: how late the slot after the last fired one is, and the gap to it."""
        reference_ms = self._fired.get(config.name, -1)
        if reference_ms < 0:  # no fired run known: count from the first failed slot (the last would read on time)
            reference_ms = self._failing_since.get(config.name, self._handled.get(config.name, -1))
        key = (config.schedule, reference_ms)
        cached = self._following.get(config.name)
        if cached is None or cached[0] != key:
            following = config.schedule.next_after(reference_ms) if reference_ms >= 0 else None
            cached = self._following[config.name] = (key, following)
        following_ms = cached[1]
        if following_ms is None:
            metrics.PERIODIC_LATE.labels(config.name).set(0)
            return
        metrics.PERIODIC_LATE.labels(config.name).set(max(0, now_ms - following_ms) / 1000)
        metrics.PERIODIC_PERIOD.labels(config.name).set((following_ms - reference_ms) / 1000)


def scheduler_loops(broker: Broker, options: ConsumerOptions) -> list[PeriodicLoop]:
    """The periodic scheduler of a consumer, or none with `--no-scheduler`."""
    if not options.scheduler:
        return []
    return [PeriodicLoop(broker, settings.TASKS_CONFIG_REFRESH_S, settings.TASKS_PERIODIC_GRACE_S)]
