"""Database models: task types (tuned in the admin, carrying the queue's permissions), API tokens, periodic tasks."""

import hashlib
import logging
import secrets
from datetime import datetime
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models, transaction
from django.utils import timezone

from tasks_app.periodic.schedule import schedule_errors
from tasks_app.protocol.codec import MAX_JSON_DEPTH, compact_json, depth, encode_arguments, payload_of
from tasks_app.protocol.keys import NAME_PATTERN, NAME_RULE
from tasks_app.protocol.records import datetime_of_ms

logger = logging.getLogger(__name__)

# \Z, not $: "$" also matches before a final line end, which no key may hold (the producer refuses it).
name_validator = RegexValidator(rf"^{NAME_PATTERN.pattern}\Z", f"Use {NAME_RULE}.")

# The permissions TaskType.Meta declares.
ENQUEUE_PERMISSION = "tasks_app.enqueue_task"
MANAGE_DEAD_LETTERS_PERMISSION = "tasks_app.manage_dead_letters"
CANCEL_PERMISSION = "tasks_app.cancel_task"
PAUSE_QUEUE_PERMISSION = "tasks_app.pause_queue"
DELETE_TASK_RECORDS_PERMISSION = "tasks_app.delete_task_records"

# Bounds (s) the admin holds fields to; a row written past them (`QuerySet.update()`) is read as the nearest.
RATE_PERIOD_MIN_S = 0.001
RATE_PERIOD_MAX_S = 86400 * 365
TIMEOUT_MIN_S = 0.001
UNIQUE_FOR_MAX_S = 86400 * 365
RESULT_TTL_MAX_S = 86400 * 3650  # ten years: a PositiveIntegerField holds it everywhere

# A limit key names a keyword argument of the handler.
kwarg_validator = RegexValidator(r"^[A-Za-z_][A-Za-z0-9_]*\Z", "Use the name of a keyword argument, e.g. tenant_id.")


def name_field(help_text: str, **options: Any) -> "models.CharField[str, str]":
    """A name that goes into Redis keys (a type, handler, queue or schedule): the names rule."""
    return models.CharField(max_length=100, validators=[name_validator], help_text=help_text, **options)


def optional_limit_field(help_text: str) -> models.PositiveIntegerField:
    """A throttle's limit: a positive count, empty for unlimited."""
    return models.PositiveIntegerField(null=True, blank=True, validators=[MinValueValidator(1)], help_text=help_text)


def limit_key_field(help_text: str) -> models.CharField:
    """A throttle's key: the name of the keyword argument whose values are limited each on their own."""
    return models.CharField(max_length=100, blank=True, default="", validators=[kwarg_validator], help_text=help_text)


class TaskType(models.Model):
    """A kind of task: which handler runs it, on which queue, how fast and how persistently."""

    class RateAlgorithm(models.TextChoices):
        GCRA = "gcra", "GCRA (exact: never more than the limit in any window)"
        FIXED_WINDOW = "fixed_window", "Fixed window (may admit up to 2x at a window edge)"

    class UniqueUntil(models.TextChoices):
        WINDOW = "window", "The end of the window"
        FINISHED = "finished", "The task finishes (or the window ends)"

    class KeepResults(models.TextChoices):
        ALWAYS = "always", "Always"
        FAILURES = "failures", "Failures only"
        NEVER = "never", "Never"

    name = name_field("The type name producers enqueue, e.g. billing.send_invoice.", unique=True)
    handler = name_field("The registered handler that runs tasks of this type.")
    queue = name_field("Queue a task goes to when the producer does not name one.", default="default")
    enabled = models.BooleanField(
        default=True,
        help_text="Disabled types cannot be enqueued, and queued tasks of this type wait "
        "(without using attempts) until it is enabled again.",
    )
    rate_limit = optional_limit_field(
        "Rate: at most this many tasks of this type start per rate period, across all "
        "consumers (a task over the limit waits in the delayed set without using an attempt). "
        "Empty means unlimited."
    )
    rate_limit_key = limit_key_field(
        "Key: the name of a keyword argument, e.g. tenant_id. The rate limit then applies "
        "to each value of it on its own (10 per second per tenant, not 10 per second in all), so one "
        "tenant's flood never delays another's tasks. Needs a rate limit. Empty: one limit for the type."
    )
    rate_period = models.FloatField(
        default=1.0,
        validators=[MinValueValidator(RATE_PERIOD_MIN_S), MaxValueValidator(RATE_PERIOD_MAX_S)],
        help_text="Length of the rate-limit window in seconds.",
    )
    rate_burst = models.PositiveIntegerField(
        default=1,
        validators=[MinValueValidator(1)],
        help_text="How many tasks may start back to back before the limit spaces them out "
        "(never more than the rate limit itself). Any window of the rate period still starts "
        "at most the rate limit, so with GCRA a burst of b lowers the steady rate to "
        "(limit - b + 1) per period; 1 keeps the full rate.",
    )
    rate_algorithm = models.CharField(
        max_length=20,
        choices=RateAlgorithm.choices,
        default=RateAlgorithm.GCRA,
        help_text="GCRA holds the limit in every sliding window; fixed window is the "
        "cheaper classic, which can admit twice the limit across a window boundary.",
    )
    max_attempts = models.PositiveIntegerField(
        default=3,
        validators=[MinValueValidator(1), MaxValueValidator(1000)],
        help_text="Runs allowed before a failing task is dead-lettered (1 = no retries).",
    )
    retry_backoff = models.FloatField(
        default=2.0,
        validators=[MinValueValidator(0), MaxValueValidator(86400)],
        help_text="Base of the exponential backoff in seconds: retry n waits about "
        "backoff * 2^(n-1), with jitter, capped at one hour.",
    )
    timeout = models.FloatField(
        null=True,
        blank=True,
        validators=[MinValueValidator(TIMEOUT_MIN_S)],
        help_text="Seconds a run may take before it is failed (and retried). Empty means no limit.",
    )
    unique_for_s = models.FloatField(
        null=True,
        blank=True,
        validators=[MinValueValidator(0.001), MaxValueValidator(UNIQUE_FOR_MAX_S)],
        help_text="Unique tasks: while a task of this type with the same uniqueness key (by default "
        "its arguments) was enqueued less than this many seconds ago, another enqueue returns that "
        "task's id and enqueues nothing. Empty means off.",
    )
    unique_until = models.CharField(
        max_length=10,
        choices=UniqueUntil.choices,
        default=UniqueUntil.WINDOW,
        help_text="When a unique task's key is freed: at the end of the window, or as soon as the "
        "task finishes (succeeds, fails for good or is cancelled), whichever comes first.",
    )
    max_running = optional_limit_field(
        "Cap: at most this many tasks of this type run at once, across all consumers (1: never "
        "two at a time). A task finding every slot taken waits in the delayed set without using an attempt "
        "and starts as soon as a slot frees; a consumer that dies frees its slots when its lease expires. "
        "Combines with the rate limit (both hold). Empty means unlimited."
    )
    max_running_key = limit_key_field(
        "Key of the cap: the name of a keyword argument, e.g. tenant_id; the cap then applies "
        "to each value of it on its own (at most N at once per tenant). Needs a cap. Empty: one cap for "
        "the type."
    )
    keep_results = models.CharField(
        max_length=10,
        choices=KeepResults.choices,
        default=KeepResults.ALWAYS,
        help_text="Which result records are kept once a task ends: every one; only those of tasks that "
        "failed (a success or a cancel leaves none); or none. A record lives while its task waits or "
        "runs whatever this says.",
    )
    result_ttl = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1), MaxValueValidator(RESULT_TTL_MAX_S)],
        help_text="Seconds a kept result record of this type lives. Empty: TASKS_RESULT_TTL.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        permissions = [
            ("enqueue_task", "Can enqueue tasks (form and API)"),
            ("manage_dead_letters", "Can requeue and delete dead-lettered tasks"),
            ("cancel_task", "Can cancel tasks (task page, API, task browser)"),
            ("pause_queue", "Can pause and resume queues"),
            ("delete_task_records", "Can delete task records from the task browser"),
        ]

    def __str__(self) -> str:
        return self.name

    def save(self, *args: Any, **kwargs: Any) -> None:
        """Save; a move to another queue also saves the periodic tasks that follow the type's queue."""
        with transaction.atomic():
            moved = self.pk is not None and TaskType.objects.filter(pk=self.pk).exclude(queue=self.queue).exists()
            super().save(*args, **kwargs)
            if moved:
                self.periodic_tasks.filter(queue="").update(updated_at=saved_now())

    def clean(self) -> None:
        """Reject settings that do not fit together (a burst over its limit, a key or an end without its limit)."""
        errors: dict[str, str] = {}
        if self.rate_limit is not None and self.rate_burst > self.rate_limit:
            errors["rate_burst"] = (
                f"The burst ({self.rate_burst}) cannot exceed the rate limit ({self.rate_limit}): at most "
                f"{self.rate_limit} tasks may start in any {self.rate_period:g}-second window."
            )
        if self.rate_limit_key and self.rate_limit is None:
            errors["rate_limit_key"] = "A rate limit key needs a rate limit: set one, or clear the key."
        if self.max_running_key and self.max_running is None:
            errors["max_running_key"] = "A cap key needs a cap (max running): set one, or clear the key."
        if self.unique_until == self.UniqueUntil.FINISHED and self.unique_for_s is None:
            errors["unique_until"] = (
                "Keeping a task unique until it finishes needs a window (unique for): without one the type "
                "is not unique at all. Set the window, or choose the end of the window."
            )
        if errors:
            raise ValidationError(errors)


class ApiToken(models.Model):
    """A per-user API token; only its SHA-256 is stored, the token itself is shown once."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100, help_text="What the token is for, e.g. billing-service.")
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    key_prefix = models.CharField(
        max_length=8,
        editable=False,
        help_text="The first characters of the token, to recognise it.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)
    revoked_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="Set to revoke the token; requests with it are then refused.",
    )

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "API token"

    def __str__(self) -> str:
        return f"{self.name} ({self.key_prefix}…)"

    @staticmethod
    def hash_of(secret: str) -> str:
        """The SHA-256 hex digest under which a token is stored."""
        return hashlib.sha256(secret.encode()).hexdigest()

    def new_secret(self) -> str:
        """Give this unsaved row a fresh secret, kept only as its hash; return the secret (shown once)."""
        secret = secrets.token_urlsafe(32)
        self.key_hash, self.key_prefix = self.hash_of(secret), secret[:8]
        return secret


def _local_now() -> datetime:
    """This host's now: a new row's stamp until it is saved (the Redis server's now, see PeriodicTask.save)."""
    return timezone.now()


def saved_now() -> datetime:
    """The Redis server's now, to stamp a saved schedule with; this host's clock if Redis does not answer."""
    from tasks_app.protocol.broker import get_broker  # the broker's settings are read at call time

    try:
        return datetime_of_ms(get_broker().inspect.server_time_ms()) or timezone.now()
    except Exception as exc:  # Redis away: the save goes on, on this host's clock
        logger.warning("periodic task saved on this host's clock, Redis did not answer: %r", exc)
        return timezone.now()


class PeriodicTask(models.Model):
    """A task enqueued on a schedule (an interval or a cron expression), fired once per slot by the consumers."""

    class CatchUp(models.TextChoices):
        SKIP = "skip", "Skip: slots missed while no consumer ran are dropped; the next slot runs"
        ONCE = "once", "Once: one run for all the slots missed, as soon as a consumer is up"

    class Source(models.TextChoices):
        ADMIN = "admin", "Admin"
        CODE = "code", "Code (TASKS_PERIODIC)"

    name = name_field("Name of the schedule, e.g. reports.nightly.", unique=True)
    task_type = models.ForeignKey(
        TaskType,
        on_delete=models.PROTECT,
        related_name="periodic_tasks",
        help_text="The type of task each run enqueues.",
    )
    args = models.JSONField(default=list, blank=True, help_text="Positional arguments, a JSON array.")
    kwargs = models.JSONField(default=dict, blank=True, help_text="Keyword arguments, a JSON object.")
    interval_s = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Run every this many seconds (slots counted from start_at, else from the epoch). "
        "Leave empty when a cron expression is given.",
    )
    cron = models.CharField(
        max_length=200,
        blank=True,
        help_text="Cron expression: minute hour day month weekday (e.g. 0 3 * * *), or 6 fields with "
        "seconds first. Leave empty when an interval is given.",
    )
    timezone = models.CharField(
        max_length=64, default="UTC", help_text="IANA time zone the cron expression is read in, e.g. Europe/Berlin."
    )
    enabled = models.BooleanField(default=True, help_text="Disabled schedules fire nothing.")
    start_at = models.DateTimeField(null=True, blank=True, help_text="No run before this time.")
    end_at = models.DateTimeField(null=True, blank=True, help_text="No run after this time.")
    queue = name_field("Queue of the runs; empty: the type's queue.", blank=True)
    priority = models.IntegerField(
        default=0, validators=[MinValueValidator(-100), MaxValueValidator(100)], help_text="-100..100, higher first."
    )
    catch_up = models.CharField(
        max_length=10,
        choices=CatchUp.choices,
        default=CatchUp.SKIP,
        help_text="What happens to slots missed while no consumer ran.",
    )
    source = models.CharField(
        max_length=10,
        choices=Source.choices,
        default=Source.ADMIN,
        editable=False,
        help_text="Rows from code are rewritten from TASKS_PERIODIC whenever consumers start.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    # On the Redis server's clock (see save): the fire script compares slots with it.
    updated_at = models.DateTimeField(default=_local_now, editable=False, blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def save(self, *args: Any, **kwargs: Any) -> None:
        """Save, stamped with the Redis server's now: no slot up to a save runs, whatever this host's clock says."""
        self.updated_at = saved_now()
        if kwargs.get("update_fields") is not None:
            kwargs["update_fields"] = {*kwargs["update_fields"], "updated_at"}
        super().save(*args, **kwargs)

    def clean(self) -> None:
        """Reject a bad cron or time zone, both or neither of cron and interval, odd arguments or dates."""
        self.cron = (self.cron or "").strip()
        fields = (self.interval_s, self.cron, self.timezone or "", self.start_at, self.end_at)
        errors = {name: f"{text[0].upper()}{text[1:]}." for name, text in schedule_errors(*fields).items()}
        if errors := {**errors, **argument_errors(self.args, self.kwargs)}:
            raise ValidationError(errors)


def argument_errors(args: Any, kwargs: Any) -> dict[str, str]:
    """Field name -> what is wrong with a schedule's arguments; empty if every run could carry them."""
    errors: dict[str, str] = {}
    if not isinstance(args, list):
        errors["args"] = 'Arguments must be a JSON array, e.g. [1, "a"].'
    if not isinstance(kwargs, dict):
        errors["kwargs"] = 'Keyword arguments must be a JSON object, e.g. {"days": 7}.'
    if errors:
        return errors
    # What the producer would refuse at every slot (NaN, a lone surrogate, too many bytes), said once
    # here; and nesting refused at enqueue from outside (which the database may not even store).
    sizes = {}
    for name, value in (("args", args), ("kwargs", kwargs)):
        if depth(value) > MAX_JSON_DEPTH:  # counted as the enqueue form and the API count it
            errors[name] = f"JSON nested too deeply (at most {MAX_JSON_DEPTH} levels)."
            continue
        try:
            sizes[name] = len(compact_json(value, allow_nan=False).encode())
        except (TypeError, ValueError) as exc:
            errors[name] = f"Not JSON that a task can carry (no NaN or Infinity, no lone surrogates): {exc}."
    limit = settings.TASKS_MAX_PAYLOAD_BYTES
    if not errors and (size := len(payload_of(*encode_arguments(args, kwargs)))) > limit:
        largest = max(sizes, key=sizes.__getitem__)
        errors[largest] = f"The arguments take {size} bytes, over the limit of {limit} (TASKS_MAX_PAYLOAD_BYTES)."
    return errors
