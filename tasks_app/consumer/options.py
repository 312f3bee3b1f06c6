"""How a consumer runs: the options `runconsumer` flags map onto, and their validation."""

from dataclasses import dataclass, field

from tasks_app.protocol.keys import validate_name

# Longest lease or grace period (s): beyond it a thread's join or wait overflows the platform's time_t.
MAX_DURATION_S = 7 * 86400
MAX_CONCURRENCY = 1024
MAX_PREFETCH = 1000
MAX_ASYNC_CONCURRENCY = 100_000
MAX_PROCESSES = 256
MAX_WEIGHT = 1000


@dataclass
class ConsumerOptions:
    """How a consumer runs; `runconsumer` flags map onto these one to one."""

    queues: list[str] = field(default_factory=lambda: ["default"])
    weights: dict[str, int] = field(default_factory=dict)
    concurrency: int = 8
    prefetch: int | None = None  # tasks claimed beyond the running ones; None: automatic (claiming.py)
    lease_s: float = 30.0
    grace_s: float = 30.0
    consumer_id: str | None = None
    burst: bool = False
    block_s: float = 2.0
    health_file: str | None = None
    scheduler: bool = True
    # Process mode (see supervisor.py): recycling, hard limits, the beat file.
    max_tasks: int | None = None
    max_memory_mb: int | None = None
    hard_limit_grace_s: float | None = None
    supervisor_beat: str | None = None
    supervisor_pid: int | None = None  # the process that started this one (its parent once it is gone: init)
    supervisor_lifeline: int | None = None  # a pipe's read end: at its EOF the supervisor is gone
    async_concurrency: int = 100

    def __post_init__(self) -> None:
        # A queue named twice is one queue: two claimers under one id would each return the other's claims as strays.
        self.queues = list(dict.fromkeys(self.queues))

    def validate(self) -> None:
        """Raise ValueError for options that cannot work."""
        if not self.queues:
            raise ValueError("at least one queue is needed")
        for name in self.queues:
            validate_name(name, "queue")
        for name, weight in self.weights.items():
            if name not in self.queues:
                raise ValueError(f"--weight names queue {name!r}, which is not among the consumer's queues")
            if not 1 <= weight <= MAX_WEIGHT:
                raise ValueError(f"the weight of queue {name!r} must be from 1 to {MAX_WEIGHT}, got {weight}")
        bounded = [("concurrency", self.concurrency, 1, MAX_CONCURRENCY)]
        bounded += [("async concurrency", self.async_concurrency, 1, MAX_ASYNC_CONCURRENCY)]
        if self.prefetch is not None:
            bounded.append(("prefetch", self.prefetch, 0, MAX_PREFETCH))
        for name, count, low, high in bounded:
            if not low <= count <= high:
                raise ValueError(f"{name} must be from {low} to {high}, got {count}")
        if not 0.5 <= self.lease_s <= MAX_DURATION_S:
            raise ValueError(f"lease must be between 0.5 and {MAX_DURATION_S} s")
        for name, value in (("grace", self.grace_s), ("timeout grace", self.hard_limit_grace_s)):
            if value is not None and not 0 <= value <= MAX_DURATION_S:
                raise ValueError(f"{name} must be between 0 and {MAX_DURATION_S} s")
        if self.consumer_id is not None:
            validate_name(self.consumer_id, "consumer id")
