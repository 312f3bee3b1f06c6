"""An id whose lease was lost on some queues only is renewed where it holds tasks, deregistered where it holds none."""

from tasks_app.consumer.retiring import RetiringIds
from tests.support.broker_calls import make_task, register
from tests.support.counters import sample
from tests.test_foreign_key_types import spoil_as_string

REFUSED = "taskqueue_queue_refused_total"


def test_a_retiring_id_is_renewed_while_it_holds_tasks_then_deregistered_giving_back_the_rest(broker):
    register(broker, "old", lease_ms=1000, queues=("a", "b"))
    broker.client.lpush(broker.keys.processing("a", "old"), make_task(1, queue="a"))
    held = {("a", "old")}
    retiring = RetiringIds(broker, 60.0, lambda queue, consumer_id: {(queue, consumer_id)} & held)
    retiring.retire("old", ["a", "b"])
    retiring.renew()
    assert broker.client.zscore(broker.keys.consumers("a"), "old") > broker.client.time()[0] * 1000 + 30_000
    assert broker.client.zscore(broker.keys.consumers("b"), "old") is None, "nothing held there: deregistered"
    held.clear()  # its run settled; an unstarted task is still in its list
    retiring.renew()
    assert broker.client.zscore(broker.keys.consumers("a"), "old") is None
    assert broker.queue_stats("a").pending == 1, "what it held unstarted went back uncounted"
    retiring.renew()  # nothing left to retire


def _retiring(broker, held: set[tuple[str, str]]) -> RetiringIds:
    register(broker, "old", lease_ms=1000, queues=("a", "b"))
    retiring = RetiringIds(broker, 60.0, lambda queue, consumer_id: {(queue, consumer_id)} & held)
    retiring.retire("old", ["a", "b"])
    return retiring


def test_a_queue_refusing_a_retiring_ids_leave_keeps_no_other_queue_from_it(broker, caplog):
    retiring = _retiring(broker, set())
    spoil_as_string(broker, broker.keys.consumers("a"))
    refused_before = sample(REFUSED, loop="retiring", queue="a")
    retiring.renew()  # before: the refusal at queue a stopped the pass, and b was never left
    assert broker.client.zscore(broker.keys.consumers("b"), "old") is None
    assert sample(REFUSED, loop="retiring", queue="a") - refused_before == 1
    [said] = [m for m in caplog.messages if "of queue a refused by Redis" in m]
    assert "WRONGTYPE" in said and broker.keys.consumers("a") in said
    broker.client.delete(broker.keys.consumers("a"))
    retiring.renew()  # tried again at the next pass
    assert retiring._queues == {}


def test_a_queue_refusing_a_retiring_ids_renewal_keeps_no_other_queue_from_it(broker):
    retiring = _retiring(broker, {("a", "old"), ("b", "old")})
    spoil_as_string(broker, broker.keys.consumer_info("a"))
    retiring.renew()  # before: the refused renewal at queue a failed the pass, and b's lease lapsed
    assert broker.client.zscore(broker.keys.consumers("b"), "old") > broker.client.time()[0] * 1000 + 30_000
    assert retiring._queues == {"old": ["a", "b"]}, "neither renewed nor lost at a: tried again"
