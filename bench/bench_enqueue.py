"""Enqueue throughput: one `producer.enqueue` call per task, and `enqueue_many` batches."""
from ours import run
from support import emit
from workloads import Sizes, run_enqueue

if __name__ == "__main__":
    sizes = Sizes(single=5000, bulk=100000, batch=1000)
    emit({"bench": "enqueue", "batch": sizes.batch, **run(run_enqueue, sizes)})
