"""Every Prometheus metric of the consumer, declared once. Labels: task type and queue (periodic ones: the schedule)."""

from typing import Any, NamedTuple

from prometheus_client import Counter, Gauge, Histogram

PREFIX = "taskqueue"

TASKS_STARTED = Counter(f"{PREFIX}_tasks_started", "Task runs started.", ["type", "queue"])
TASKS_SUCCEEDED = Counter(f"{PREFIX}_tasks_succeeded", "Task runs that returned.", ["type", "queue"])
TASKS_FAILED = Counter(f"{PREFIX}_tasks_failed", "Task runs that raised or timed out.", ["type", "queue"])
TASKS_RETRIED = Counter(f"{PREFIX}_tasks_retried", "Failed tasks scheduled to run again.", ["type", "queue"])
TASKS_DEAD_LETTERED = Counter(f"{PREFIX}_tasks_dead_lettered", "Tasks moved to the dead-letter set.", ["type", "queue"])
TASKS_RECOVERED = Counter(f"{PREFIX}_tasks_recovered", "Tasks returned to pending from dead consumers.", ["queue"])
TASKS_DEFERRED = Counter(
    f"{PREFIX}_tasks_deferred", "Tasks put back without using an attempt.", ["type", "queue", "reason"]
)
ACKS_LOST = Counter(f"{PREFIX}_acks_lost", "Finished tasks no longer held by this consumer (it was reaped).", ["queue"])
RATE_LIMIT_DECISIONS = Counter(f"{PREFIX}_rate_limit_decisions", "Rate-limit gate decisions.", ["type", "decision"])
CONCURRENCY_DECISIONS = Counter(
    f"{PREFIX}_concurrency_decisions", "Concurrency-cap (max_running) slot decisions.", ["type", "decision"]
)
TASK_DURATION = Histogram(
    f"{PREFIX}_task_duration_seconds",
    "Run time of task handlers.",
    ["type", "queue"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
TASK_WAIT = Histogram(
    f"{PREFIX}_task_wait_seconds",
    "Time from enqueue (or due time) to start.",
    ["type", "queue"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 3600),
)
IN_FLIGHT = Gauge(f"{PREFIX}_consumer_in_flight_tasks", "Tasks this consumer has claimed and not yet finished.")
BUSY_WORKERS = Gauge(f"{PREFIX}_consumer_busy_workers", "Worker threads running a handler.")
PREFETCH = Gauge(
    f"{PREFIX}_consumer_prefetch",
    "Tasks this consumer may claim beyond its running ones now (automatic: follows its pace).",
)
TASK_TYPES_AGE = Gauge(
    f"{PREFIX}_consumer_task_types_age_seconds",
    "Seconds since this consumer last read the task types from the database (+Inf before its first read).",
)
LEASE_RENEWALS = Counter(f"{PREFIX}_lease_renewals", "Successful lease renewals.")
LEASES_LOST = Counter(f"{PREFIX}_leases_lost", "Times this consumer found its lease gone and re-registered.")
REDIS_ERRORS = Counter(f"{PREFIX}_redis_errors", "Redis errors met by consumer loops.", ["loop"])
QUEUE_STATS_ERRORS = Counter(f"{PREFIX}_queue_stats_errors", "Scrapes whose queue depths could not be read in time.")
RESULT_REPLICATION_TIMEOUTS = Counter(
    f"{PREFIX}_result_replication_timeouts",
    "Redis Cluster masters whose replica did not confirm a flush's results "
    "within TASKS_CLUSTER_WAIT_MS (the tasks were acked anyway).",
)
TASKS_CANCELLED = Counter(
    f"{PREFIX}_tasks_cancelled",
    "Tasks that ended CANCELLED on a consumer: dropped before they started, or stopped by their handler.",
    ["type", "queue"],
)
DUPLICATES_REFUSED = Counter(
    f"{PREFIX}_duplicates_refused",
    "Enqueues of a unique task type answered with the id of a task already enqueued (nothing pushed).",
    ["type"],
)
PERIODIC_FIRED = Counter(f"{PREFIX}_periodic_fired", "Runs of periodic schedules this consumer pushed.", ["schedule"])
PERIODIC_LATE = Gauge(
    f"{PREFIX}_periodic_late_seconds",
    "How long the slot after a schedule's last fired one has been due without a run (0: on time).",
    ["schedule"],
)
PERIODIC_PERIOD = Gauge(
    f"{PREFIX}_periodic_period_seconds", "Gap between a schedule's last fired slot and the next.", ["schedule"]
)
WORKFLOWS_STARTED = Counter(
    f"{PREFIX}_workflows_started", "Workflows stored and started by an enqueue (a repeated enqueue of one is not)."
)
WORKFLOWS_FINISHED = Counter(
    f"{PREFIX}_workflows_finished",
    "Workflows that ended, by status: SUCCESSFUL, FAILED or CANCELLED "
    "(a FAILED one that goes on, or is then cancelled, counts again when it ends).",
    ["status"],
)
WORKFLOW_STEPS_FIRED = Counter(
    f"{PREFIX}_workflow_steps_fired",
    "Tasks a workflow started when the tasks they wait for ended: chains' next steps, chords' callbacks.",
)


class RunMetrics(NamedTuple):
    """The per-run metrics of one task type on one queue, their labelled children looked up once."""

    started: Any
    succeeded: Any
    duration: Any
    wait: Any


# Labelled children by (type, queue): a look-up through `labels()` takes a lock and checks the
# labels, four times per run. As bounded as the metrics themselves (one child per pair either way).
_run_metrics: dict[tuple[str, str], RunMetrics] = {}


def of_run(task_type: str, queue: str) -> RunMetrics:
    """The per-run metrics of `task_type` on `queue`."""
    labels = (task_type, queue)
    found = _run_metrics.get(labels)
    if found is None:
        found = _run_metrics[labels] = RunMetrics(
            TASKS_STARTED.labels(*labels),
            TASKS_SUCCEEDED.labels(*labels),
            TASK_DURATION.labels(*labels),
            TASK_WAIT.labels(*labels),
        )
    return found
