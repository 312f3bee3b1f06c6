"""Profile the producer with cProfile: bulk `enqueue_many` batches, or one `enqueue` call per task.

Not run by `make bench`. Usage: `python bench/profile_enqueue.py [bulk|single] [top N]`.
"""

import cProfile
import pstats
import sys

from ours import our_system

BATCHES = 50
BATCH = 1000
SINGLE = 5000

if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "bulk"
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
    with our_system() as (system, client):
        system.enqueue_tasks(BATCH)  # warm up the connection, the type cache and the queue set
        system.enqueue_task()
        profiler = cProfile.Profile()
        profiler.enable()
        if mode == "single":
            for _ in range(SINGLE):
                system.enqueue_task()
        else:
            for _ in range(BATCHES):
                system.enqueue_tasks(BATCH)
        profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)
