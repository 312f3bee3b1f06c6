"""Workflows on a real Redis with consumers in threads: the shapes, inputs, policies, validation, reading."""

from __future__ import annotations

import json

import pytest
from django.test import Client

import tests.support.workflow_handlers  # noqa: F401  (registers the workflow handlers in this process)
from tasks_app import workflows
from tasks_app.producer import TaskRequest
from tasks_app.protocol import workflows as workflows_protocol
from tasks_app.workflows import WorkflowError, chain, chord, group
from tests.support.processes import wait_until
from tests.support.workflow_handlers import runs_key

pytestmark = pytest.mark.django_db(transaction=True)


def runs(broker) -> list[dict]:
    return [json.loads(line) for line in broker.client.lrange(runs_key(), 0, -1)]


def ended(broker, workflow_id: str, status: str = workflows.SUCCESSFUL, timeout_s: float = 30):
    wait_until(
        lambda: workflows.get_workflow(workflow_id).status == status,
        timeout_s,
        message=lambda: f"workflow {status}: {workflows.get_workflow(workflow_id)}",
    )
    return workflows.get_workflow(workflow_id)


def test_a_chain_passes_each_return_value_to_the_next_step(broker, consumer_in_thread):
    flow = chain(
        TaskRequest("wf.value", args=[1]),
        TaskRequest("wf.add", args=[10]),
        TaskRequest("wf.add", args=[100]),
        TaskRequest("wf.value", args=["own"], immutable=True),
    )
    with consumer_in_thread():
        handle = flow.enqueue()
        state = ended(broker, handle.id)
    assert [r["args"] for r in runs(broker)] == [[1], [1, 10], [11, 100], ["own"]]
    assert state.result == "own"
    assert state.counts == {workflows.SUCCESSFUL: 4}
    assert [m.task_id for m in state.members] == [workflows.task_id_of(handle.id, f"0.{n}") for n in range(4)]


def test_a_chord_calls_back_once_with_the_results_in_member_order(broker, consumer_in_thread):
    flow = chord([TaskRequest("wf.value", args=[n]) for n in range(20)], then=TaskRequest("wf.collect", args=["x"]))
    with consumer_in_thread(concurrency=8):
        handle = flow.enqueue()
        state = ended(broker, handle.id)
    [callback] = [r for r in runs(broker) if r["type"] == "wf.collect"]
    assert callback["args"] == [list(range(20)), "x"]
    assert state.callback_ids == [workflows.task_id_of(handle.id, "0.1")]
    assert len(state.member_ids) == 20
    assert state.result == 20


def test_nesting_a_chain_in_a_chord_and_a_chord_in_a_chain(broker, consumer_in_thread):
    inner = chord(
        [chain(TaskRequest("wf.value", args=[n]), TaskRequest("wf.add", args=[1])) for n in range(3)],
        then=TaskRequest("wf.collect"),
    )
    flow = chain(TaskRequest("wf.value", args=["start"]), inner, TaskRequest("wf.add", args=[1000]))
    with consumer_in_thread(concurrency=4):
        state = ended(broker, flow.enqueue().id)
    collected = [r["args"] for r in runs(broker) if r["type"] == "wf.collect"]
    # Each chain's first step gets the step before the chord's value, then its own argument.
    assert collected == [[[1, 2, 3]]]
    assert state.result == 1003
    assert state.tree["children"][1]["kind"] == "chain"
    assert state.tree["children"][1]["children"][0]["kind"] == "group"


def test_an_unknown_type_in_the_tenth_member_enqueues_nothing(broker):
    members = [TaskRequest("wf.value", args=[n]) for n in range(9)] + [TaskRequest("no.such.type")]
    with pytest.raises(WorkflowError, match=r"step 0\.0\.9 .*no\.such\.type"):
        chord(members, then=TaskRequest("wf.collect")).enqueue()
    assert list(broker.client.scan_iter(match=f"{broker.keys.prefix}:*")) == []


@pytest.mark.parametrize(
    ("flow", "problem"),
    [
        (lambda: group(), "is empty"),
        (lambda: chain(TaskRequest("wf.value", args=[object()])), "JSON"),
        (lambda: chain(TaskRequest("wf.value", task_id="mine")), "derive from the workflow"),
        (lambda: chain("wf.value"), "a step is a TaskRequest"),
        (lambda: chain(TaskRequest("wf.value"), on_failure="ignore"), "on_failure"),
        (lambda: group(*[TaskRequest("wf.value")] * 10_001), "over 10000"),
    ],
)
def test_a_bad_workflow_is_refused_whole(broker, flow, problem):
    with pytest.raises(WorkflowError, match=problem):
        flow().enqueue()
    assert list(broker.client.scan_iter(match=f"{broker.keys.prefix}:*")) == []


def test_limits_of_size_and_depth_are_settings(broker, settings):
    settings.TASKS_WORKFLOW_MAX_TASKS = 5
    with pytest.raises(WorkflowError, match="TASKS_WORKFLOW_MAX_TASKS"):
        group(*[TaskRequest("wf.value")] * 6).enqueue()
    settings.TASKS_WORKFLOW_MAX_DEPTH = 2
    with pytest.raises(WorkflowError, match="TASKS_WORKFLOW_MAX_DEPTH"):
        chain(chain(chain(TaskRequest("wf.value")))).enqueue()
    assert list(broker.client.scan_iter(match=f"{broker.keys.prefix}:*")) == []


def test_enqueue_again_with_the_same_id_pushes_nothing_twice(broker):
    flow = group(TaskRequest("wf.value", args=[1]), TaskRequest("wf.value", args=[2]))
    first = flow.enqueue(workflow_id="wf-1")
    again = flow.enqueue(workflow_id="wf-1")
    assert first == again
    assert broker.client.llen(broker.keys.pending("default")) == 2
    with pytest.raises(WorkflowError, match="names another workflow"):
        group(TaskRequest("wf.value", args=[3])).enqueue(workflow_id="wf-1")


def test_a_callback_input_over_the_payload_limit_fails_the_workflow(broker, settings, consumer_in_thread):
    settings.TASKS_MAX_PAYLOAD_BYTES = 2000
    flow = chord([TaskRequest("wf.value", args=["x" * 600]) for _ in range(4)], then=TaskRequest("wf.collect"))
    with consumer_in_thread():
        state = ended(broker, flow.enqueue().id, workflows.FAILED)
    assert "over TASKS_MAX_PAYLOAD_BYTES" in state.error
    assert state.failed_task_id == workflows.task_id_of(state.id, "0.1")
    assert not [r for r in runs(broker) if r["type"] == "wf.collect"]


def test_a_failed_step_stops_its_chain_and_its_requeue_goes_on(broker, consumer_in_thread):
    steps = [TaskRequest("wf.add", args=[n]) for n in range(5)]
    steps[0] = TaskRequest("wf.value", args=[0])
    steps[2] = TaskRequest("wf.fails_until_fixed", args=[2])
    with consumer_in_thread():
        handle = chain(*steps).enqueue()
        state = ended(broker, handle.id, workflows.FAILED)
        assert state.failed_task_id == workflows.task_id_of(handle.id, "0.2")
        assert "not fixed yet" in state.error
        assert state.counts == {workflows.SUCCESSFUL: 2, workflows.FAILED: 1, workflows.WAITING: 2}
        broker.client.set(f"{broker.keys.prefix}:test:fixed", 1)
        dead = broker.inspect.list_dead_tasks("default")
        assert [d.task.id for d in dead if d.task] == [state.failed_task_id]
        broker.inspect.requeue_dead_tasks("default", dead)
        state = ended(broker, handle.id)
    assert [r["args"] for r in runs(broker)] == [[0], [0, 1], [1, 2], [1, 2], [2, 3], [5, 4]]
    assert state.result == 9


def test_continue_puts_an_error_entry_in_the_failed_members_place(broker, consumer_in_thread):
    members = [TaskRequest("wf.value", args=[n]) for n in range(100)]
    members[40] = TaskRequest("wf.fails_until_fixed", args=[40])
    with consumer_in_thread(concurrency=8):
        handle = chord(members, then=TaskRequest("wf.collect"), on_failure="continue").enqueue()
        state = ended(broker, handle.id, timeout_s=60)
    [callback] = [r["args"][0] for r in runs(broker) if r["type"] == "wf.collect"]
    failed_id = workflows.task_id_of(handle.id, "0.0.40")
    error = {"exception_class": "tasks_app.exceptions.PermanentError", "message": "not fixed yet", "task_id": failed_id}
    assert callback == [*range(40), {"error": error}, *range(41, 100)]
    assert state.counts == {workflows.SUCCESSFUL: 100, workflows.FAILED: 1}


def test_a_cancelled_workflow_starts_nothing_more(broker, consumer_in_thread):
    flow = chain(TaskRequest("wf.value", args=[1]), TaskRequest("wf.hold", args=[2]), TaskRequest("wf.value", args=[3]))
    with consumer_in_thread():
        handle = flow.enqueue()
        wait_until(lambda: any(r["type"] == "wf.hold" for r in runs(broker)), 30, message="the second step to start")
        cancelled = workflows.cancel_workflow(handle.id, cancelled_by="test")
        assert cancelled.task_ids == [workflows.task_id_of(handle.id, "0.1")]
        broker.client.set(f"{broker.keys.prefix}:test:release", 1)
        wait_until(
            lambda: workflows.get_workflow(handle.id).counts.get(workflows.SUCCESSFUL) == 2, 30, message="the hold"
        )
    state = workflows.get_workflow(handle.id)
    assert state.status == workflows.CANCELLED
    assert [r["args"] for r in runs(broker)] == [[1], [1, 2]]
    assert state.counts == {workflows.SUCCESSFUL: 2, workflows.WAITING: 1}
    assert workflows.cancel_workflow(handle.id).cancelled is False


def test_a_cancelled_member_fails_a_stop_chord(broker, consumer_in_thread):
    flow = chord([TaskRequest("wf.value", args=[n], delay_s=1) for n in range(3)], then=TaskRequest("wf.collect"))
    handle = flow.enqueue()
    from tasks_app import cancel

    cancel(handle.task_ids["0.0.1"])
    with consumer_in_thread():
        state = ended(broker, handle.id, workflows.FAILED)
        wait_until(lambda: workflows.get_workflow(handle.id).counts.get(workflows.SUCCESSFUL) == 2, 30)
    assert state.failed_task_id == handle.task_ids["0.0.1"]
    assert "TaskCancelled" in state.error
    assert not [r for r in runs(broker) if r["type"] == "wf.collect"]


def test_the_workflow_command_shows_and_cancels(broker):
    from io import StringIO

    from django.core.management import CommandError, call_command

    handle = chord([TaskRequest("wf.value", args=[n]) for n in range(3)], then=TaskRequest("wf.collect")).enqueue()
    out = StringIO()
    call_command("workflow", "show", handle.id, stdout=out)
    shown = json.loads(out.getvalue())
    assert shown["status"] == workflows.RUNNING
    assert shown["counts"] == {"READY": 3, workflows.WAITING: 1}
    assert shown["callback_ids"] == [handle.task_ids["0.1"]]
    out = StringIO()
    call_command("workflow", "cancel", handle.id, stdout=out)
    assert "3 started task(s) asked to stop" in out.getvalue()
    assert workflows.get_workflow(handle.id).status == workflows.CANCELLED
    assert {broker.records.get_result(handle.task_ids[f"0.0.{n}"])["status"] for n in range(3)} == {"CANCELLED"}
    with pytest.raises(CommandError, match="already ended"):
        call_command("workflow", "cancel", handle.id, stdout=StringIO())
    with pytest.raises(CommandError, match="no workflow"):
        call_command("workflow", "show", "nope", stdout=StringIO())


def test_the_api_reads_and_cancels_a_workflow(broker, staff):
    handle = chain(TaskRequest("wf.value", args=[1]), TaskRequest("wf.add", args=[2])).enqueue()
    answer = staff.get(f"/api/workflows/{handle.id}/")
    assert answer.status_code == 200
    assert answer.json()["tree"]["children"][0] == {
        "path": "0.0",
        "kind": "task",
        "task_id": handle.task_ids["0.0"],
        "type": "wf.value",
        "status": "READY",
    }
    answer = staff.post(f"/api/workflows/{handle.id}/cancel/")
    assert answer.status_code == 200
    assert answer.json()["cancelled_task_ids"] == [handle.task_ids["0.0"]]
    assert staff.post(f"/api/workflows/{handle.id}/cancel/").status_code == 409
    assert staff.get("/api/workflows/nope/").status_code == 404
    assert Client().get(f"/api/workflows/{handle.id}/").status_code == 401


# --- the script that records an end, driven directly -------------------------------------------
def _end(broker, workflow_id: str, path: str, value: object = 1, owner=None):
    return broker.workflows.end(
        workflow_id, path, workflows.SUCCESSFUL, json.dumps(value), max_input_bytes=10_000, ttl_s=60, owner=owner
    )


def test_an_end_recorded_twice_answers_the_same_starts_and_counts_once(broker):
    handle = chord([TaskRequest("wf.value", args=[n]) for n in range(3)], then=TaskRequest("wf.collect")).enqueue()
    assert _end(broker, handle.id, "0.0.0", "a") == (workflows_protocol.RECORDED, [], "")
    assert _end(broker, handle.id, "0.0.0", "again") == (workflows_protocol.RECORDED_BEFORE, [], "")
    _end(broker, handle.id, "0.0.2", "c")
    first = _end(broker, handle.id, "0.0.1", "b")
    assert first == (workflows_protocol.RECORDED, [workflows_protocol.Started("0.1", '["a","b","c"]')], "")
    assert _end(broker, handle.id, "0.0.1", "b") == (workflows_protocol.RECORDED_BEFORE, first.started, "")
    assert _end(broker, handle.id, "0.0.2", "c").started == []  # it started nothing
    # The callback's end ends the workflow, and says so once.
    assert _end(broker, handle.id, "0.1", 3) == (workflows_protocol.RECORDED, [], workflows.SUCCESSFUL)
    assert _end(broker, handle.id, "0.1", 3) == (workflows_protocol.RECORDED_BEFORE, [], "")
    # Once the callback ended, a late repeat of the last member's end answers nothing to push.
    assert _end(broker, handle.id, "0.0.1", "b") == (workflows_protocol.RECORDED_BEFORE, [], "")
    assert workflows.get_workflow(handle.id).status == workflows.SUCCESSFUL
    assert 0 < broker.client.ttl(broker.keys.workflow(handle.id)[0]) <= 60


def test_members_ending_at_once_start_the_callback_once(broker):
    from concurrent.futures import ThreadPoolExecutor

    members = [TaskRequest("wf.value", args=[n]) for n in range(200)]
    handle = chord(members, then=TaskRequest("wf.collect")).enqueue()
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda n: _end(broker, handle.id, f"0.0.{n}", n), range(200)))
    [callback] = [answer.started for answer in answers if answer.started]
    assert callback == [workflows_protocol.Started("0.1", json.dumps(list(range(200)), separators=(",", ":")))]


def test_an_end_of_a_run_that_lost_its_task_records_nothing(broker):
    handle = chain(TaskRequest("wf.value", args=[1]), TaskRequest("wf.value", args=[2])).enqueue()
    owner = workflows_protocol.Owner("default", "c1", b"not in the list")
    assert _end(broker, handle.id, "0.0", owner=owner).code == workflows_protocol.NOT_OWNED
    broker.client.rpush(broker.keys.processing("default", "c1"), b"the task")
    owner = workflows_protocol.Owner("default", "c1", b"the task")
    assert _end(broker, handle.id, "0.0", owner=owner) == (workflows_protocol.RECORDED, [("0.1", "1")], "")


def test_an_end_naming_no_task_of_the_workflow_records_nothing(broker):
    handle = chain(TaskRequest("wf.value", args=[1]), TaskRequest("wf.value", args=[2])).enqueue()
    for path in ("0", "0.7", "", "x"):
        assert _end(broker, handle.id, path).code == workflows_protocol.NO_WORKFLOW
    assert _end(broker, "no-such-workflow", "0.0").code == workflows_protocol.NO_WORKFLOW
    assert workflows.get_workflow(handle.id).counts == {"READY": 1, workflows.WAITING: 1}


def test_a_retry_from_the_task_browser_ends_the_failed_place(broker, staff, consumer_in_thread):
    flow = chain(TaskRequest("wf.fails_until_fixed", args=[1]), TaskRequest("wf.add", args=[2]))
    with consumer_in_thread():
        handle = flow.enqueue()
        ended(broker, handle.id, workflows.FAILED)
        broker.client.set(f"{broker.keys.prefix}:test:fixed", 1)
        form = {"action": "retry", "task": [handle.task_ids["0.0"]], f"retried_as:{handle.task_ids['0.0']}": ""}
        assert staff.post("/tasks/?status=FAILED", form).status_code == 302
        state = ended(broker, handle.id)
    assert state.result == 3
    assert [r["args"] for r in runs(broker)] == [[1], [1], [1, 2]]


def test_django_tasks_are_steps_with_their_arguments(broker, consumer_in_thread):
    from tasks_app.workflows import step
    from tests.support import django_tasks

    flow = chain(step(django_tasks.add, 1, 2), step(django_tasks.add, 10), django_tasks.echo)
    with consumer_in_thread():
        state = ended(broker, flow.enqueue().id)
    assert state.result["args"] == [13]


def test_a_django_task_step_is_the_request_its_enqueue_would_make(settings):
    # Before: a step kept a naive run_after (allowed with USE_TZ = False), which its enqueue() makes aware.
    from datetime import datetime, timedelta

    from django.utils import timezone

    from tasks_app.workflows import step
    from tests.support import django_tasks

    settings.USE_TZ = False
    run_after = datetime.now() + timedelta(minutes=1)
    request = step(django_tasks.add.using(run_after=run_after, priority=5), 1, immutable=True)
    assert request.run_after == timezone.make_aware(run_after)
    assert (request.type, request.args, request.priority, request.immutable) == (
        django_tasks.add.module_path,
        (1,),
        5,
        True,
    )


def test_a_callback_that_is_a_chain_counts_as_callbacks(broker):
    flow = chord([TaskRequest("wf.value", args=[1])], then=chain(TaskRequest("wf.collect"), TaskRequest("wf.add")))
    state = workflows.get_workflow(flow.enqueue().id)
    assert [m.path for m in state.members if m.callback] == ["0.1.0", "0.1.1"]


def test_a_workflow_containing_itself_is_refused(broker):
    from dataclasses import replace

    loop = chain(TaskRequest("wf.value"))
    object.__setattr__(loop, "nodes", (*loop.nodes, replace(loop)))
    object.__setattr__(loop.nodes[1], "nodes", (loop,))
    with pytest.raises(WorkflowError, match="contains itself"):
        loop.enqueue()


def test_async_members_end_their_places_too(broker, consumer_in_thread):
    flow = chord([TaskRequest("wf.async_value", args=[n]) for n in range(5)], then=TaskRequest("wf.collect"))
    with consumer_in_thread(async_concurrency=4):
        state = ended(broker, flow.enqueue().id)
    assert state.result == 5
    assert [r["args"] for r in runs(broker) if r["type"] == "wf.collect"] == [[[0, 1, 2, 3, 4]]]


def test_a_step_pushed_after_a_cancel_raced_its_start_is_cancelled_too(broker):
    handle = chain(TaskRequest("wf.value", args=[1]), TaskRequest("wf.value", args=[2])).enqueue()
    recorded = _end(broker, handle.id, "0.0")  # its consumer recorded the end, and is about to push step 2
    assert workflows.cancel_workflow(handle.id).task_ids == [handle.task_ids["0.1"]]  # no record of it yet
    workflows.push_started(broker, handle.id, recorded.started)
    assert broker.records.get_result(handle.task_ids["0.1"])["status"] == "CANCELLED"


def _counted() -> dict[str, float]:
    from prometheus_client import REGISTRY

    def value(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(f"taskqueue_{name}_total", labels) or 0.0

    return {
        "started": value("workflows_started"),
        "fired": value("workflow_steps_fired"),
        **{status: value("workflows_finished", status=status) for status in ("SUCCESSFUL", "FAILED", "CANCELLED")},
    }


def _grown(before: dict[str, float]) -> dict[str, float]:
    return {name: count - before[name] for name, count in _counted().items() if count != before[name]}


def test_metrics_count_starts_steps_fired_and_ends_once(broker, consumer_in_thread):
    before = _counted()
    flow = chord([TaskRequest("wf.value", args=[n]) for n in range(3)], then=TaskRequest("wf.collect"))
    handle = flow.enqueue(workflow_id="metered")
    flow.enqueue(workflow_id="metered")  # a repeat stores nothing: not counted
    with consumer_in_thread():
        ended(broker, handle.id)
    assert _grown(before) == {"started": 1, "fired": 1, "SUCCESSFUL": 1}
    # The end of a member recorded again (a re-run after a kill) counts nothing.
    headers = {"workflow": handle.id, "workflow_path": "0.0.0"}
    workflows.task_ended(broker, headers, workflows.SUCCESSFUL, "0")
    assert _grown(before) == {"started": 1, "fired": 1, "SUCCESSFUL": 1}


def test_metrics_count_a_failed_and_a_cancelled_workflow(broker, consumer_in_thread):
    before = _counted()
    with consumer_in_thread():
        failed = chain(TaskRequest("wf.value", args=[1]), TaskRequest("wf.fails_until_fixed", args=[2])).enqueue()
        ended(broker, failed.id, workflows.FAILED)
    held = chain(TaskRequest("wf.value", args=[1], delay_s=600), TaskRequest("wf.value")).enqueue()
    workflows.cancel_workflow(held.id)
    workflows.cancel_workflow(held.id)  # ended already: not counted again
    assert _grown(before) == {"started": 2, "fired": 1, "FAILED": 1, "CANCELLED": 1}
