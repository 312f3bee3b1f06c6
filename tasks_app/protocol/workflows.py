"""`Workflows`: a workflow's tree and progress in its own keys: create, record a task's end, stop, read.

Every key of one workflow shares its hash tag (`P:wf:{<id>}`), so each script runs on one slot of a
Redis Cluster, wherever its tasks' queues live (docs/PROTOCOL.md, "Workflows").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import redis

from tasks_app.protocol.queue import Queue
from tasks_app.protocol.scripts import Role, ScriptClient, reply_text

# What workflow_create answers: stored now (2: stored before from the same tree; 0: another tree has the id).
CREATED = 1
# What workflow_end answers.
RECORDED = 1  # recorded now
RECORDED_BEFORE = 2  # recorded by an earlier call: its starts are answered again
NO_WORKFLOW = 0  # no such workflow (never created, or expired)
NOT_OWNED = -1  # the run no longer owns its task: nothing recorded


class Started(NamedTuple):
    """A task of a workflow to push now: its path, and the input its steps before it produced (None: none)."""

    path: str
    input_json: str | None


class Recorded(NamedTuple):
    """What recording a task's end did (RECORDED...), what it started, and the workflow's end status ("": none)."""

    code: int
    started: list[Started]
    ended: str = ""


class Owner(NamedTuple):
    """The run settling a task: its queue, consumer and the task as claimed (checked on one server)."""

    queue: str
    consumer_id: str
    raw: bytes


@dataclass(frozen=True)
class WorkflowData:
    """A workflow's keys as they read now (text)."""

    meta: dict[str, str]
    nodes: dict[str, str]  # path -> spec ("t", "g <n> <policy>", "c <n> <policy>")
    steps: dict[str, str]  # task path -> envelope template (JSON)
    started: set[str]  # task paths pushed, or to be pushed
    outcomes: dict[str, str]  # task path -> SUCCESSFUL, FAILED or CANCELLED
    failed: dict[str, str]  # task path -> error entry (JSON): failed under "stop", not ended
    result: str | None  # the root's value (JSON) once it ended


def _text(values: Any) -> Any:
    if isinstance(values, dict):
        return {reply_text(k): reply_text(v) for k, v in values.items()}
    return [reply_text(v) for v in values]


def _started(reply: Sequence[Any]) -> list[Started]:
    pairs = [reply_text(item) for item in reply[2:]]
    return [Started(path, value[1:] if value else None) for path, value in zip(pairs[::2], pairs[1::2], strict=True)]


class Workflows(Role):
    """A workflow's scripts and reads, each on the workflow's own slot."""

    def __init__(self, redis_client: ScriptClient, queue: Queue) -> None:
        super().__init__(redis_client)
        self.queue = queue  # its instance token

    def create(
        self, workflow_id: str, digest: str, nodes: Sequence[tuple[str, str, str]], tasks: int, ttl_s: int
    ) -> tuple[int, list[Started]]:
        """Store a workflow's tree (path, spec, template per node) and start it: (1 created, 2 created before from
        the same tree, 0 another tree has this id; the tasks to push now)."""
        args: list[Any] = [digest, ttl_s, tasks]
        for node in nodes:
            args.extend(node)
        reply = self.redis.run("workflow_create", self.keys.workflow(workflow_id), args)
        return int(reply[0]), _started(reply)

    def end(
        self,
        workflow_id: str,
        path: str,
        outcome: str,
        value_json: str,
        *,
        max_input_bytes: int,
        ttl_s: int,
        owner: Owner | None = None,
    ) -> Recorded:
        """Record the end of a workflow's task once (only while `owner` holds it, on one server); what it started."""
        keys = self.keys.workflow(workflow_id)
        args: list[Any] = [path, outcome, value_json, max_input_bytes, ttl_s]
        if owner is not None and not isinstance(self.client, redis.RedisCluster):
            keys += [self.keys.processing(owner.queue, owner.consumer_id), self.keys.consumer_info(owner.queue)]
            args += [owner.raw, owner.consumer_id, self.queue.instance]
        reply = self.redis.run("workflow_end", keys, args)
        return Recorded(int(reply[0]), _started(reply), reply_text(reply[1]) if len(reply) > 1 else "")

    def stop(self, workflow_id: str, status: str, reason: str, ttl_s: int, path: str = "") -> tuple[int, list[str]]:
        """End a running (or failed, for a cancel) workflow with `status`: (1 stopped, 2 ended already, 0 none; the
        paths of the tasks started whose end is not recorded, or the status it had ended with)."""
        reply = self.redis.run("workflow_stop", self.keys.workflow(workflow_id), [status, reason, ttl_s, path])
        return int(reply[0]), _text(reply[1:])

    def templates(self, workflow_id: str, paths: Sequence[str]) -> list[str]:
        """The envelope templates of tasks of a workflow, by path."""
        if not paths:
            return []
        return [reply_text(t) for t in self.client.hmget(self.keys.workflow(workflow_id)[2], list(paths))]

    def task_paths(self, workflow_id: str) -> list[str]:
        """The paths of a workflow's tasks, in no order (none if there is no such workflow)."""
        return [reply_text(p) for p in self.client.hkeys(self.keys.workflow(workflow_id)[2])]

    def status(self, workflow_id: str) -> str | None:
        """A workflow's status (RUNNING, SUCCESSFUL, FAILED, CANCELLED), None if there is none."""
        value = self.client.hget(self.keys.workflow(workflow_id)[0], "status")
        return None if value is None else reply_text(value)

    def read(self, workflow_id: str) -> WorkflowData | None:
        """Read a workflow's keys in one round trip; None if there is none."""
        meta, nodes, steps, starts, results, outcomes, failed, _ = self.keys.workflow(workflow_id)
        pipe = self.client.pipeline(transaction=False)
        for key in (meta, nodes, steps, outcomes, failed):
            pipe.hgetall(key)
        pipe.hkeys(starts)
        pipe.hget(results, "0")
        meta_d, nodes_d, steps_d, outcomes_d, failed_d, started, result = pipe.execute()
        if not meta_d:
            return None
        return WorkflowData(
            _text(meta_d),
            _text(nodes_d),
            _text(steps_d),
            set(_text(started)),
            _text(outcomes_d),
            _text(failed_d),
            None if result is None else reply_text(result),
        )
