"""Demo handlers, so a newcomer can try every path of the queue at once (`make run` enables them)."""

import time
from typing import Any

from tasks_app import handler


@handler("demo.echo")
def echo(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """Return the arguments it was given."""
    return {"args": list(args), "kwargs": kwargs}


@handler("demo.sleep")
def sleep(seconds: float = 1.0) -> float:
    """Sleep for `seconds`, then return them."""
    time.sleep(float(seconds))
    return float(seconds)


@handler("demo.fail")
def fail(message: str = "demo.fail always fails") -> None:
    """Raise every time: the way to see retries and the dead-letter list."""
    raise RuntimeError(message)


@handler("demo.flaky", takes_context=True)
def flaky(context: Any, failures: int = 2) -> str:
    """Fail on the first `failures` attempts, then succeed."""
    if context.attempt <= int(failures):
        raise RuntimeError(f"flaky failure on attempt {context.attempt} of {int(failures) + 1}")
    return f"succeeded on attempt {context.attempt}"
