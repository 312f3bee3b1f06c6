"""What every chaos scenario shares: scale, a fleet of consumer processes, tallies and the summary line."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import UndecodableTask, decode_task
from tasks_app.protocol.keys import WAKE_TOKEN
from tests.conftest import ARTIFACTS_DIR
from tests.support.processes import ConsumerProcess, wait_until
from tests.support.recording import recorded_runs

LONG = os.environ.get("CHAOS_SCALE", "short") == "long"
LEASE_S = 2.0
SUMMARY_PATH = ARTIFACTS_DIR / "chaos-summary.jsonl"
FINISHED = ("SUCCESSFUL", "FAILED")


def scaled(short: int | float, long: int | float) -> Any:
    """Pick the short (make test) or long (make chaos) figure."""
    return long if LONG else short


@dataclass
class Summary:
    """The one-line result of a scenario."""

    scenario: str
    tasks: int
    runs: int
    lost: int
    duplicates: int
    duplicates_allowed: int
    recovery_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def report(self) -> None:
        """Print the summary line and append it to test-artifacts/chaos-summary.jsonl."""
        line = {"scale": "long" if LONG else "short", **asdict(self)}
        if line["recovery_s"] is not None:
            line["recovery_s"] = round(line["recovery_s"], 3)
        line["at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        print(
            f"\nCHAOS {self.scenario}: tasks={self.tasks} runs={self.runs} lost={self.lost} "
            f"duplicates={self.duplicates} duplicates_allowed={self.duplicates_allowed} "
            f"recovery_s={line['recovery_s']} {json.dumps(self.extra) if self.extra else ''}".rstrip()
        )
        SUMMARY_PATH.parent.mkdir(parents=True, exist_ok=True)
        with SUMMARY_PATH.open("a") as out:
            out.write(json.dumps(line) + "\n")


def seeded_rng(scenario: str) -> random.Random:
    """A random generator seeded from CHAOS_SEED or a fresh seed, printed so that a failing run replays."""
    seed = int(os.environ.get("CHAOS_SEED") or random.SystemRandom().randrange(2**32))
    print(f"\nCHAOS {scenario}: seed={seed} (replay with CHAOS_SEED={seed})")
    return random.Random(seed)


def task_ids(raws: Iterable[bytes]) -> set[str]:
    """Ids of the tasks among serialized entries (wake tokens and garbage are skipped)."""
    ids = set()
    for raw in raws:
        try:
            ids.add(decode_task(raw).id)
        except UndecodableTask:
            continue
    return ids


class Fleet:
    """The consumer subprocesses of one scenario, by id: spawn, freeze, kill with a snapshot, respawn."""

    def __init__(
        self,
        start_process: Callable[..., ConsumerProcess],
        broker: Broker,
        queues: Sequence[str] = ("default",),
        *,
        concurrency: int = 8,
        prefetch: int | None = 8,
        lease_s: float = LEASE_S,
        **env: str,
    ) -> None:
        self.start_process = start_process
        self.broker = broker
        self.queues = list(queues)
        self.args = [
            "--lease",
            str(lease_s),
            "--concurrency",
            str(concurrency),
            "--grace",
            "10",
            *(["--prefetch", str(prefetch)] if prefetch is not None else []),
            *[arg for q in self.queues for arg in ("--queue", q)],
        ]
        self.env = env
        self.processes: dict[str, ConsumerProcess] = {}
        self.in_flight_at_kills: set[str] = set()
        self.killed_at: dict[str, float] = {}

    def spawn(self, consumer_id: str) -> ConsumerProcess:
        """Start a `runconsumer` with this id."""
        process = self.start_process(*self.args, "--consumer-id", consumer_id, name=consumer_id, **self.env)
        self.processes[consumer_id] = process
        return process

    def wait_registered(self, consumer_ids: Iterable[str], timeout_s: float = 60) -> None:
        """Wait until every id holds a lease on the first queue."""
        wanted = set(consumer_ids)
        wait_until(
            lambda: wanted <= {c["id"] for c in self.broker.inspect.queue_stats(self.queues[0]).consumers},
            timeout_s,
            interval_s=0.1,
            message=f"consumers {sorted(wanted)} to register",
        )

    def identities(self, consumer_id: str) -> list[str]:
        """The ids the process started as `consumer_id` has used: its own and `<id>.<n>` after a lost lease."""
        client, keys = self.broker.client, self.broker.keys
        found = {consumer_id}
        for queue in self.queues:
            for member in [*client.zrange(keys.consumers(queue), 0, -1), *client.zrange(keys.reaped(queue), 0, -1)]:
                name = member.decode()
                if name.startswith(f"{consumer_id}."):
                    found.add(name)
        return sorted(found)

    def held(self, consumer_id: str) -> list[bytes]:
        """Everything in the processing lists of this one id."""
        return [
            raw
            for q in self.queues
            for raw in self.broker.client.lrange(self.broker.keys.processing(q, consumer_id), 0, -1)
        ]

    def held_by_process(self, consumer_id: str) -> set[str]:
        """Ids of the tasks in the processing lists of every id the consumer process has used."""
        return task_ids([raw for cid in self.identities(consumer_id) for raw in self.held(cid)])

    def running(self, consumer_id: str) -> set[str]:
        """Ids of the tasks the consumer holds whose handler started there (under any of its ids)."""
        started = set().union(*(started_on(self.broker, cid) for cid in self.identities(consumer_id)))
        return self.held_by_process(consumer_id) & started

    def freeze(self, consumer_id: str) -> set[str]:
        """SIGSTOP a consumer and return the ids of the tasks it holds (under any of its ids) once it cannot move."""
        self.processes[consumer_id].signal(signal.SIGSTOP)
        time.sleep(0.05)  # let commands it already sent finish on the server
        return self.held_by_process(consumer_id)

    def kill(self, consumer_id: str) -> set[str]:
        """Freeze, snapshot the processing list, then SIGKILL the process group; return the snapshot."""
        snapshot = self.freeze(consumer_id)
        self._kill_frozen(consumer_id, snapshot)
        return snapshot

    def kill_while_running(
        self, consumer_id: str, timeout_s: float = 30, between_looks: Callable[[], None] = lambda: None
    ) -> tuple[set[str], set[str]]:
        """SIGKILL a consumer at a moment when it holds tasks whose handler started there.

        Returns the tasks it held and those of them that had started. Waits until it looks busy,
        then freezes and looks again, thawing it to retry while it holds no started task.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            # Freeze only once it looks busy: freezing it over and over would starve its heartbeat.
            if self.running(consumer_id) or time.monotonic() > deadline:
                held = self.freeze(consumer_id)
                running = held & self.running(consumer_id)
                if running or time.monotonic() > deadline:
                    break
                self.processes[consumer_id].signal(signal.SIGCONT)
            between_looks()  # e.g. keep the load going, or the queue drains and it never looks busy
            time.sleep(0.01)
        self._kill_frozen(consumer_id, held)
        assert running, f"{consumer_id} never held a started task within {timeout_s} s"
        return held, running

    def _kill_frozen(self, consumer_id: str, snapshot: set[str]) -> None:
        self.processes[consumer_id].kill()
        self.killed_at[consumer_id] = time.monotonic()
        self.in_flight_at_kills |= snapshot

    def recovered_within(self, consumer_id: str, timeout_s: float) -> float:
        """Wait until a killed consumer's lists are empty (its tasks back in pending); return seconds since the kill."""
        killed_at = self.killed_at[consumer_id]
        wait_until(
            lambda: not self.held_by_process(consumer_id),
            killed_at + timeout_s - time.monotonic(),
            interval_s=0.02,
            message=f"the tasks of {consumer_id} to be back in pending within {timeout_s} s of the kill",
        )
        return time.monotonic() - killed_at

    def logs(self) -> str:
        return "\n".join(f"--- {cid}\n{p.log()[-3000:]}" for cid, p in self.processes.items())


def started_on(broker: Broker, consumer_id: str) -> set[str]:
    """Ids of the tasks whose `test.record` run started under this consumer id."""
    return {run["task_id"] for run in recorded_runs(broker) if run["consumer"] == consumer_id}


def leftovers(broker: Broker, queues: Iterable[str], *, dead: bool = True) -> dict[str, int]:
    """Every non-empty structure of the queues with its length: pending (wake tokens aside), prioritized,
    delayed, suspects, dead (unless `dead` is False) and every processing list, whoever it belongs to."""
    client = broker.client
    found: dict[str, int] = {}
    for queue in queues:
        keys = broker.keys
        found[keys.pending(queue)] = sum(raw != WAKE_TOKEN for raw in client.lrange(keys.pending(queue), 0, -1))
        for key in (keys.prioritized(queue), keys.delayed(queue), *([keys.dead(queue)] if dead else [])):
            found[key] = client.zcard(key)
        found[keys.suspects(queue)] = client.llen(keys.suspects(queue))
        for key in client.scan_iter(match=keys.processing(queue, "*"), count=1000):
            found[key.decode()] = client.llen(key)
    return {key: length for key, length in found.items() if length}


def settled_leftovers(
    broker: Broker, queues: Iterable[str], timeout_s: float = 2 * LEASE_S, *, dead: bool = True
) -> dict[str, int]:
    """`leftovers`, once they are empty or `timeout_s` has passed without them shrinking.

    Acks are written in batches, and recovered tasks (suspects) run one at a time per consumer:
    a loaded machine drains a few of them more slowly than `timeout_s`, while it keeps draining.
    """
    queues = list(queues)
    deadline = time.monotonic() + timeout_s
    fewest = None
    while (left := leftovers(broker, queues, dead=dead)) and time.monotonic() < deadline:
        if fewest is None or sum(left.values()) < fewest:
            fewest, deadline = sum(left.values()), time.monotonic() + timeout_s
        time.sleep(0.1)
    return left


def statuses(broker: Broker, ids: Sequence[str]) -> dict[str, str | None]:
    """Each task's result status (None when it has no record)."""
    pipe = broker.client.pipeline(transaction=False)
    for task_id in ids:
        pipe.hget(broker.keys.result(task_id), "status")
    return {task_id: value.decode() if value else None for task_id, value in zip(ids, pipe.execute(), strict=True)}


def wait_finished(broker: Broker, ids: Sequence[str], timeout_s: float, fleet: Fleet | None = None) -> None:
    """Wait until every task has a final status."""

    def done() -> bool:
        return all(status in FINISHED for status in statuses(broker, ids).values())

    try:
        wait_until(done, timeout_s, interval_s=0.25, message=f"{len(ids)} tasks to finish")
    except AssertionError:
        final = statuses(broker, ids)
        unfinished = {task_id for task_id, status in final.items() if status not in FINISHED}
        ran = sum(run["task_id"] in unfinished for run in recorded_runs(broker))
        raise AssertionError(
            f"tasks did not finish: {dict(Counter(final.values()))} ({ran} runs of the unfinished "
            f"ones recorded); where: {locate(broker, fleet, unfinished)}; in Redis: "
            f"{leftovers(broker, fleet.queues if fleet else ['default'])}\n"
            f"{fleet.logs() if fleet else ''}"
        ) from None


def locate(broker: Broker, fleet: Fleet | None, wanted: set[str]) -> dict[str, str]:
    """Where the given tasks are now: pending, prioritized, suspects, delayed, dead or a consumer's processing list."""
    queues = fleet.queues if fleet else ["default"]
    places: dict[str, list[bytes]] = {}
    for queue in queues:
        places[f"{queue}:pending"] = broker.client.lrange(broker.keys.pending(queue), 0, -1)
        places[f"{queue}:prioritized"] = broker.client.zrange(broker.keys.prioritized(queue), 0, -1)
        places[f"{queue}:suspects"] = broker.client.lrange(broker.keys.suspects(queue), 0, -1)
        places[f"{queue}:delayed"] = [m[4:] for m in broker.client.zrange(broker.keys.delayed(queue), 0, -1)]
        places[f"{queue}:dead"] = broker.client.zrange(broker.keys.dead(queue), 0, -1)
        for consumer_id in fleet.processes if fleet else []:
            for suffix in ("", ".1", ".2"):
                key = broker.keys.processing(queue, consumer_id + suffix)
                places[f"{queue}:processing:{consumer_id}{suffix}"] = broker.client.lrange(key, 0, -1)
    found = {place: sorted(task_ids(raws) & wanted) for place, raws in places.items()}
    return {place: f"{len(ids)} task(s), e.g. {ids[:3]}" for place, ids in found.items() if ids}


@dataclass
class Tally:
    """Runs per task as `test.record` saw them, against the tasks enqueued."""

    runs: Counter[str]
    lost: list[str]
    duplicates: set[str]

    @property
    def total_runs(self) -> int:
        return sum(self.runs.values())


def tally(broker: Broker, ids: Sequence[str], *, per_attempt: bool = False) -> Tally:
    """Count runs; a task is lost if it never succeeded, a duplicate if it ran more than once.

    Where the handler can fail (e.g. its own Redis call while Redis is down), pass
    `per_attempt`: a retry after a failed attempt is a new attempt, and only an attempt that
    ran twice is a duplicate. Elsewhere every run beyond the first is one.
    """
    recorded = recorded_runs(broker)
    runs = Counter(run["task_id"] for run in recorded)
    attempts = Counter((run["task_id"], run["attempt"]) for run in recorded)
    final = statuses(broker, ids)
    lost = [task_id for task_id in ids if final[task_id] != "SUCCESSFUL" or not runs[task_id]]
    if per_attempt:
        duplicates = {task_id for (task_id, _), count in attempts.items() if count > 1}
    else:
        duplicates = {task_id for task_id, count in runs.items() if count > 1}
    return Tally(runs, lost, duplicates)
