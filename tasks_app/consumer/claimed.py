"""A claimed task as the consumer holds it: the exact bytes in its processing list, with its claim's token."""

import math
import time
from dataclasses import dataclass, field

from tasks_app.protocol.codec import Task


# Not frozen: two are built per task, and a frozen dataclass costs four times as much to build.
@dataclass(slots=True)
class Claimed:
    """A task as claimed: the exact bytes in `consumer_id`'s processing list of `queue`."""

    queue: str
    consumer_id: str
    raw: bytes
    # Recovered from a consumer that died holding it: its start is recorded before it runs.
    suspect: bool = False
    # Fencing token issued with this claim: result writes of older runs of the task are ignored.
    fence: int = 0
    # The task decoded from `raw` when its claim's receipt was written (None: not decoded yet).
    task: Task | None = field(default=None, compare=False)
    # What the task's record answered the receipt (see receipts.py): None if none was written,
    # START_REFUSED if the task was cancelled (it must not run), else it may start at once.
    receipt: int | None = field(default=None, compare=False)
    # When it was claimed (monotonic s): a task that waited here unstarted asks for cancels before it starts.
    claimed_at_s: float = field(default_factory=time.monotonic, compare=False)
    # By when (monotonic s) its handler must begin, set when its rate limit admits it (inf: no limit).
    start_by: float = field(default=math.inf, compare=False)
