"""Workflows: chains, groups and chords of tasks, whose next step or callback is pushed exactly once.

A task carries its workflow id and path in its headers; the consumer that settles it records its end
(`lua/workflow_end.lua`) before its ack, then pushes what that end started under ids derived from the
workflow, so a repeated end pushes nothing twice.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from django.conf import settings
from django.tasks import Task as DjangoTask
from redis.exceptions import RedisError

from tasks_app.exceptions import TaskCancelled
from tasks_app.metrics import WORKFLOW_STEPS_FIRED, WORKFLOWS_FINISHED, WORKFLOWS_STARTED
from tasks_app.protocol.broker import Broker, get_broker
from tasks_app.protocol.keys import InvalidName, validate_name
from tasks_app.protocol.records import WORKFLOW_HEADER, WORKFLOW_PATH_HEADER, datetime_of_ms, ms_of_datetime
from tasks_app.protocol.workflows import CREATED, NO_WORKFLOW, NOT_OWNED, RECORDED, Owner, Started

if TYPE_CHECKING:
    from tasks_app.producer import TaskRequest

logger = logging.getLogger(__name__)

MAX_GROUP_MEMBERS = 10_000
POLICIES = ("stop", "continue")
# Statuses of a workflow, and of a task of one not pushed yet.
RUNNING, SUCCESSFUL, FAILED, CANCELLED = "RUNNING", "SUCCESSFUL", "FAILED", "CANCELLED"
WAITING = "WAITING"
# The error of a cancelled task's place, as a failed run's `last_error` reads.
CANCELLED_ERROR = f"{TaskCancelled.__module__}.{TaskCancelled.__qualname__}: the task was cancelled"

Policy = Literal["stop", "continue"]


class WorkflowError(ValueError):
    """A workflow refused before anything was pushed, or an id that names no workflow."""


@dataclass(frozen=True)
class Workflow:
    """A chain or a group: its nodes in order, and what a failed node does to it (`on_failure`)."""

    nodes: tuple[Any, ...]
    on_failure: Policy = "stop"

    def enqueue(self, *, workflow_id: str | None = None, broker: Broker | None = None) -> EnqueuedWorkflow:
        """Validate the whole workflow (nothing is pushed on an error), store it and push the tasks that start at once.

        With `workflow_id` given, a repeat of the same call (after a lost reply) pushes nothing twice."""
        from tasks_app.producer import QueueUnavailable

        workflow_id = workflow_id or str(uuid.uuid4())
        try:
            validate_name(workflow_id, "workflow id")
        except InvalidName as exc:
            raise WorkflowError(str(exc)) from None
        nodes, requests = _flatten(self, workflow_id)
        digest = hashlib.sha256(json.dumps(nodes).encode()).hexdigest()
        broker = broker or get_broker()
        try:
            code, started = broker.workflows.create(
                workflow_id, digest, nodes, len(requests), int(settings.TASKS_RESULT_TTL)
            )
            if code == NO_WORKFLOW:
                raise WorkflowError(f"workflow id {workflow_id!r} names another workflow")
            if code == CREATED:
                WORKFLOWS_STARTED.inc()
            push_started(broker, workflow_id, started, requests)
        except RedisError as exc:
            problem = f"Redis did not take it ({exc}); retry with workflow_id={workflow_id!r}"
            raise QueueUnavailable(f"cannot enqueue the workflow: {problem}") from exc
        return EnqueuedWorkflow(workflow_id, {path: task_id_of(workflow_id, path) for path in requests})


class Chain(Workflow):
    """Steps run one after another; each gets the previous one's return value first (unless immutable)."""


class Group(Workflow):
    """Members run at once; the group ends with the list of their values, in member order."""


def chain(*steps: Any, on_failure: Policy = "stop") -> Chain:
    """A chain of steps (TaskRequests, `django.tasks` tasks, `step(...)`s, chains and groups)."""
    return Chain(tuple(steps), on_failure)


def group(*members: Any, on_failure: Policy = "stop") -> Group:
    """A group of members run at once (a single list or tuple is taken as the members)."""
    if len(members) == 1 and isinstance(members[0], (list, tuple)):
        members = tuple(members[0])
    return Group(tuple(members), on_failure)


def chord(members: Group | Iterable[Any], then: Any, *, on_failure: Policy = "stop") -> Chain:
    """`chain(group(members), then)`: `then` runs once with the list of the members' values; `on_failure` is both's."""
    if isinstance(members, Group):
        return chain(replace(members, on_failure=on_failure), then, on_failure=on_failure)
    return chain(group(tuple(members), on_failure=on_failure), then, on_failure=on_failure)


def step(task: DjangoTask, *args: Any, immutable: bool = False, **kwargs: Any) -> TaskRequest:
    """A `django.tasks` task with its arguments, as a workflow's step (the request its enqueue() would make)."""
    from tasks_app.django_tasks.backend import task_request
    from tasks_app.registry import registry

    registry.add_django_task(task)  # a handler now, as its enqueue() would make it
    return task_request(task, args, kwargs, immutable=immutable)


@dataclass(frozen=True)
class EnqueuedWorkflow:
    """An enqueued workflow: its id, and the id of each task by its path in the tree."""

    id: str
    task_ids: dict[str, str] = field(default_factory=dict)

    def get(self, broker: Broker | None = None) -> WorkflowState:
        """The workflow as it is now (see `get_workflow`)."""
        return get_workflow(self.id, broker=broker)


def task_id_of(workflow_id: str, path: str) -> str:
    """The fixed id of the task at `path` of a workflow: derived from both, so a repeated push is known."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"workflow:{workflow_id}/{path}"))


def error_entry(exception_class: str, message: str, task_id: str) -> dict[str, Any]:
    """What a failed task's place holds under `on_failure="continue"`."""
    return {"error": {"exception_class": exception_class, "message": message, "task_id": task_id}}


# --- enqueueing ------------------------------------------------------------------------------
def _flatten(root: Workflow, workflow_id: str) -> tuple[list[tuple[str, str, str]], dict[str, TaskRequest]]:
    """The nodes of a workflow (path, spec, template) and its tasks by path, all validated; WorkflowError if not."""
    from tasks_app.producer import EnqueueError, prepare

    if not isinstance(root, Workflow):
        raise WorkflowError(f"a workflow is a chain, group or chord, got {type(root).__name__}")
    nodes: list[tuple[str, str, str]] = []
    requests: dict[str, TaskRequest] = {}
    max_depth, max_tasks = int(settings.TASKS_WORKFLOW_MAX_DEPTH), int(settings.TASKS_WORKFLOW_MAX_TASKS)
    stack: list[tuple[Any, str, tuple[int, ...]]] = [(root, "0", ())]
    while stack:
        node, path, ancestors = stack.pop()
        if len(ancestors) > max_depth:
            raise WorkflowError(f"node {path} nests deeper than TASKS_WORKFLOW_MAX_DEPTH ({max_depth})")
        if isinstance(node, Workflow):
            nodes.append((path, _spec(node, path, ancestors), ""))
            stack.extend(
                (child, f"{path}.{at}", (*ancestors, id(node))) for at, child in reversed(list(enumerate(node.nodes)))
            )
            continue
        request = _request_of(node, path)
        requests[path] = _addressed(request, workflow_id, path)
        if len(requests) > max_tasks:
            raise WorkflowError(f"a workflow holds at most {max_tasks} tasks (TASKS_WORKFLOW_MAX_TASKS)")
        try:
            prepare([requests[path]])
        except EnqueueError as exc:
            raise WorkflowError(f"step {path} ({request.type!r:.120}): {exc}") from None
        nodes.append((path, "t", _template(request)))
    return nodes, requests


def _spec(node: Workflow, path: str, ancestors: tuple[int, ...]) -> str:
    kind = "group" if isinstance(node, Group) else "chain"
    if id(node) in ancestors:
        raise WorkflowError(f"the {kind} at {path} contains itself")
    if not node.nodes:
        raise WorkflowError(f"the {kind} at {path} is empty")
    if isinstance(node, Group) and len(node.nodes) > MAX_GROUP_MEMBERS:
        raise WorkflowError(f"the group at {path} has {len(node.nodes)} members, over {MAX_GROUP_MEMBERS}")
    if node.on_failure not in POLICIES:
        raise WorkflowError(f"on_failure must be 'stop' or 'continue', got {node.on_failure!r}")
    return f"{kind[0]} {len(node.nodes)} {node.on_failure}"


def _request_of(node: Any, path: str) -> TaskRequest:
    from tasks_app.producer import TaskRequest

    if isinstance(node, DjangoTask):
        return step(node)
    if not isinstance(node, TaskRequest):
        raise WorkflowError(
            f"step {path} is a {type(node).__name__}: a step is a TaskRequest, a django.tasks task, a chain or a group"
        )
    if node.task_id is not None:
        raise WorkflowError(f"step {path} names a task id: a workflow's task ids derive from the workflow")
    if any(name in (node.headers or {}) for name in (WORKFLOW_HEADER, WORKFLOW_PATH_HEADER)):
        reserved = f"{WORKFLOW_HEADER!r} or {WORKFLOW_PATH_HEADER!r}"
        raise WorkflowError(f"step {path} sets header {reserved}: those are the workflow's")
    return node


def _addressed(request: TaskRequest, workflow_id: str, path: str) -> TaskRequest:
    headers = {**(request.headers or {}), WORKFLOW_HEADER: workflow_id, WORKFLOW_PATH_HEADER: path}
    return replace(request, task_id=task_id_of(workflow_id, path), headers=headers)


def _template(request: TaskRequest) -> str:
    return json.dumps(
        {
            "type": request.type,
            "args": list(request.args),
            "kwargs": dict(request.kwargs),
            "queue": request.queue,
            "priority": request.priority,
            "delay_s": request.delay_s,
            "run_after_ms": None if request.run_after is None else ms_of_datetime(request.run_after),
            "headers": dict(request.headers or {}),
            "unique_key": request.unique_key,
            "immutable": request.immutable,
        },
        separators=(",", ":"),
    )


def _request_of_template(template: str) -> TaskRequest:
    from tasks_app.producer import TaskRequest

    fields = json.loads(template)
    run_after_ms = fields.pop("run_after_ms")
    return TaskRequest(**fields, run_after=None if run_after_ms is None else datetime_of_ms(run_after_ms))


def push_started(
    broker: Broker, workflow_id: str, started: Sequence[Started], known: Mapping[str, TaskRequest] | None = None
) -> None:
    """Push the tasks a workflow just started, under their fixed ids; a step that cannot be pushed fails it."""
    from tasks_app.producer import MAX_BATCH, EnqueueError, QueueUnavailable, prepare, push

    if not started:
        return
    missing = [s.path for s in started if known is None or s.path not in known]
    templates = dict(zip(missing, broker.workflows.templates(workflow_id, missing), strict=True))
    requests = []
    for start in started:
        request = (
            known[start.path]
            if known is not None and start.path in known
            else _addressed(_request_of_template(templates[start.path]), workflow_id, start.path)
        )
        if start.input_json is not None and not request.immutable:
            request = replace(request, args=[json.loads(start.input_json), *request.args])
        requests.append(request)
    for first in range(0, len(requests), MAX_BATCH):
        chunk = requests[first : first + MAX_BATCH]
        try:
            batch = prepare(chunk)
        except EnqueueError:  # one step is refused: it fails the workflow, the others are pushed
            kept = []
            for request in chunk:
                try:
                    prepare([request])
                except EnqueueError as exc:
                    _fail(broker, workflow_id, request, str(exc))
                else:
                    kept.append(request)
            chunk = kept
            batch = prepare(chunk)
        try:
            pushed = push(batch, broker=broker)
        except QueueUnavailable as exc:  # Redis away: the caller rides it out and repeats the whole end
            raise exc.__cause__ or exc from None
        for request, task in zip(chunk, pushed, strict=True):
            if task.duplicate and task.id != request.task_id:
                _fail(broker, workflow_id, request, f"its unique key is held by task {task.id}")
    if broker.workflows.status(workflow_id) == CANCELLED:  # cancelled while these were pushed: they stop too
        broker.control.cancel_many([r.task_id for r in requests if r.task_id], "workflow cancelled")


def _fail(broker: Broker, workflow_id: str, request: TaskRequest, problem: str) -> None:
    path = request.headers.get(WORKFLOW_PATH_HEADER, "")
    reason = f"step {path} ({request.type}) cannot be pushed: {problem}"
    logger.error("workflow %s failed: %s", workflow_id, reason)
    code, _ = broker.workflows.stop(workflow_id, FAILED, reason, int(settings.TASKS_RESULT_TTL), path)
    if code == 1:
        WORKFLOWS_FINISHED.labels(FAILED).inc()


# --- a task's end, recorded by the consumer that settles it ------------------------------------
def is_member(headers: Mapping[str, str]) -> bool:
    """Whether a task's headers name a workflow (the only cost a task outside a workflow pays)."""
    return WORKFLOW_HEADER in headers


def task_ended(
    broker: Broker, headers: Mapping[str, str], outcome: str, value_json: str, owner: Owner | None = None
) -> None:
    """Record a workflow task's end (its value's or error entry's JSON), then push what it started; idempotent."""
    workflow_id, path = headers.get(WORKFLOW_HEADER, ""), headers.get(WORKFLOW_PATH_HEADER, "")
    if not _valid_id(workflow_id):  # a foreign producer's headers: an id that would break a key names no workflow
        logger.warning("a task names workflow %r, which cannot be one: its end is not recorded", workflow_id[:120])
        return
    recorded = broker.workflows.end(
        workflow_id,
        path,
        outcome,
        value_json,
        max_input_bytes=int(settings.TASKS_MAX_PAYLOAD_BYTES),
        ttl_s=int(settings.TASKS_RESULT_TTL),
        owner=owner,
    )
    if recorded.code == NOT_OWNED:
        return
    if recorded.code == RECORDED:
        WORKFLOW_STEPS_FIRED.inc(len(recorded.started))
    if recorded.ended:
        WORKFLOWS_FINISHED.labels(recorded.ended).inc()
    push_started(broker, workflow_id, recorded.started)


def failed_value(task_id: str, last_error: str) -> str:
    """The error entry (JSON) of a task that failed for good with `last_error` ("module.Class: message")."""
    exception_class, _, message = last_error.partition(": ")
    return json.dumps(error_entry(exception_class, message, task_id))


# --- reading and cancelling --------------------------------------------------------------------
@dataclass(frozen=True)
class Member:
    """One task of a workflow: its place, id, type and status (WAITING until it is pushed)."""

    path: str
    task_id: str
    type: str
    status: str
    callback: bool  # it runs after a group: a chord's callback


@dataclass(frozen=True)
class WorkflowState:
    """A workflow as it is now: status, counts of its tasks by status, its tasks, and its tree."""

    id: str
    status: str
    created_at_ms: int
    ended_at_ms: int | None
    failed_task_id: str | None  # the task that failed it (FAILED)
    error: str  # why it failed (an error entry's JSON, or why a step could not be pushed)
    counts: dict[str, int]
    members: list[Member]
    tree: dict[str, Any]
    result: Any = None  # the root's value once SUCCESSFUL

    @property
    def member_ids(self) -> list[str]:
        return [m.task_id for m in self.members if not m.callback]

    @property
    def callback_ids(self) -> list[str]:
        return [m.task_id for m in self.members if m.callback]

    def as_json(self) -> dict[str, Any]:
        """The state as JSON-ready data (the API and `manage.py workflow show`)."""
        return {
            "id": self.id,
            "status": self.status,
            "created_at_ms": self.created_at_ms,
            "ended_at_ms": self.ended_at_ms,
            "failed_task_id": self.failed_task_id,
            "error": self.error,
            "counts": self.counts,
            "member_ids": self.member_ids,
            "callback_ids": self.callback_ids,
            "tree": self.tree,
        }


def get_workflow(workflow_id: str, *, broker: Broker | None = None) -> WorkflowState:
    """Read a workflow: its status, its tasks' statuses and its tree; WorkflowError if there is none."""
    broker = broker or get_broker()
    data = None if not _valid_id(workflow_id) else broker.workflows.read(workflow_id)
    if data is None:
        raise WorkflowError(f"no workflow {workflow_id!r:.120} (never enqueued, or expired)")
    running = [p for p in data.steps if p in data.started and p not in data.outcomes and p not in data.failed]
    records = broker.records.get_results([task_id_of(workflow_id, p) for p in running], ["status"])
    statuses = {p: (r or {}).get("status") or "READY" for p, r in zip(running, records, strict=True)}
    members = {
        path: Member(
            path,
            task_id_of(workflow_id, path),
            json.loads(template)["type"],
            data.outcomes.get(path) or (FAILED if path in data.failed else statuses.get(path, WAITING)),
            _is_callback(path, data.nodes),
        )
        for path, template in data.steps.items()
    }
    counts = dict(Counter(member.status for member in members.values()))
    meta = data.meta
    failed_path = meta.get("failed_path")
    ordered = sorted(members.values(), key=lambda m: tree_order(m.path))
    return WorkflowState(
        id=workflow_id,
        status=meta["status"],
        created_at_ms=int(meta["created_ms"]),
        ended_at_ms=int(meta["ended_ms"]) if meta.get("ended_ms") else None,
        failed_task_id=task_id_of(workflow_id, failed_path) if failed_path and meta["status"] == FAILED else None,
        error=meta.get("error", "") if meta["status"] == FAILED else "",
        counts=counts,
        members=ordered,
        tree=_tree("0", data.nodes, members),
        result=json.loads(data.result) if data.result is not None and meta["status"] == SUCCESSFUL else None,
    )


def task_ids(workflow_id: str, *, broker: Broker | None = None) -> list[str]:
    """The ids of a workflow's tasks in tree order, read from its own keys; WorkflowError if there is no workflow."""
    broker = broker or get_broker()
    paths = broker.workflows.task_paths(workflow_id) if _valid_id(workflow_id) else []
    if not paths:
        raise WorkflowError(f"no workflow {workflow_id!r:.120} (never enqueued, or expired)")
    return [task_id_of(workflow_id, path) for path in sorted(paths, key=tree_order)]


def tree_order(path: str) -> list[int]:
    """The sort key of a path: a node before its children, children in their order."""
    return [int(part) for part in path.split(".")]


def _valid_id(workflow_id: str) -> bool:
    try:
        validate_name(workflow_id)
    except InvalidName:
        return False
    return True


def _is_callback(path: str, nodes: Mapping[str, str]) -> bool:
    """Whether a task is, or is inside, a step that follows a group in a chain (a chord's callback)."""
    while "." in path:
        parent, _, position = path.rpartition(".")
        if nodes[parent].startswith("c") and int(position) > 0 and nodes[f"{parent}.{int(position) - 1}"][0] == "g":
            return True
        path = parent
    return False


def _tree(path: str, nodes: Mapping[str, str], members: Mapping[str, Member]) -> dict[str, Any]:
    """The tree under `path`: chains and groups with their policy and children, tasks with their id and status."""
    kind, *rest = nodes[path].split()
    if kind == "t":
        member = members[path]
        return {"path": path, "kind": "task", "task_id": member.task_id, "type": member.type, "status": member.status}
    children = [_tree(f"{path}.{at}", nodes, members) for at in range(int(rest[0]))]
    return {"path": path, "kind": "group" if kind == "g" else "chain", "on_failure": rest[1], "children": children}


@dataclass(frozen=True)
class CancelledWorkflow:
    """What `cancel_workflow` did: the status the workflow has now and the tasks it asked to stop."""

    id: str
    status: str
    cancelled: bool  # False: it had ended already (SUCCESSFUL or CANCELLED)
    task_ids: list[str] = field(default_factory=list)


def cancel_workflow(workflow_id: str, *, cancelled_by: str = "", broker: Broker | None = None) -> CancelledWorkflow:
    """Cancel a workflow: it starts nothing more, and every task started and not ended is cancelled."""
    broker = broker or get_broker()
    if not _valid_id(workflow_id):
        raise WorkflowError(f"no workflow {workflow_id!r:.120}")
    code, rest = broker.workflows.stop(workflow_id, CANCELLED, cancelled_by, int(settings.TASKS_RESULT_TTL))
    if code == NO_WORKFLOW:
        raise WorkflowError(f"no workflow {workflow_id!r:.120} (never enqueued, or expired)")
    if code != 1:
        return CancelledWorkflow(workflow_id, rest[0], False)
    WORKFLOWS_FINISHED.labels(CANCELLED).inc()
    task_ids = [task_id_of(workflow_id, path) for path in rest]
    if task_ids:
        broker.control.cancel_many(task_ids, cancelled_by or "workflow cancelled")
    return CancelledWorkflow(workflow_id, CANCELLED, True, task_ids)
