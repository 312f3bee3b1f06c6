"""A claimed task as the consumer holds it: the exact bytes in its processing list, with its claim's token."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Claimed:
    """A task as claimed: the exact bytes in `consumer_id`'s processing list of `queue`."""

    queue: str
    consumer_id: str
    raw: bytes
    # Recovered from a consumer that died holding it: its start is recorded before it runs.
    suspect: bool = False
    # Fencing token issued with this claim: result writes of older runs of the task are ignored.
    fence: int = 0
