"""Scale-out: 1, 2 and 4 consumer processes draining the same backlog; tasks/s for each count."""

import os

from ours import our_system
from support import emit
from workloads import Sizes, run_drain

COUNTS = (1, 2, 4)

if __name__ == "__main__":
    sizes = Sizes(drain=30000)
    rates: dict[str, int] = {}
    with our_system() as (system, client):
        for count in COUNTS:
            rates[str(count)] = run_drain(system, client, sizes, workers=count)["drain_per_s"]
    emit(
        {
            "bench": "scale_out",
            "tasks": sizes.drain,
            "nproc": os.cpu_count(),
            "drain_per_s": rates,
            "speedup_2_over_1": round(rates["2"] / rates["1"], 2),
            "speedup_4_over_1": round(rates["4"] / rates["1"], 2),
        }
    )
