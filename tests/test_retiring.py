"""An id whose lease was lost on some queues only is renewed where it holds tasks, deregistered where it holds none."""

from tasks_app.consumer.membership import RetiringIds
from tests.support.broker_calls import make_task, register


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
    assert broker.inspect.queue_stats("a").pending == 1, "what it held unstarted went back uncounted"
    retiring.renew()  # nothing left to retire


def _retiring(broker, held: set[tuple[str, str]]) -> RetiringIds:
    register(broker, "old", lease_ms=1000, queues=("a", "b"))
    retiring = RetiringIds(broker, 60.0, lambda queue, consumer_id: {(queue, consumer_id)} & held)
    retiring.retire("old", ["a", "b"])
    return retiring
