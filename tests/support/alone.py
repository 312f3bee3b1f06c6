"""Tests marked `alone` run while no other test runs, also when pytest-xdist spreads the suite over workers.

Every test holds a shared lock on a file of this run from its setup to its teardown; an `alone`
test holds it exclusively. A turnstile taken first lets a waiting `alone` test go next instead of
being starved by the stream of shared holders. The lock directory is made by the controlling
process and handed to each worker through xdist's `workerinput`.
"""

from __future__ import annotations

import contextlib
import fcntl
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

WORKER_INPUT_KEY = "alone_lock_dir"
LOCK_DIR = pytest.StashKey[Path]()


def pytest_configure(config: pytest.Config) -> None:
    """Make the lock directory (controller or plain run) or find the controller's (xdist worker)."""
    worker_input = getattr(config, "workerinput", None)
    if worker_input is None:
        config.stash[LOCK_DIR] = Path(tempfile.mkdtemp(prefix="pytest-alone-"))
    else:
        config.stash[LOCK_DIR] = Path(worker_input[WORKER_INPUT_KEY])


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """Tell a starting xdist worker where the lock directory is."""
    node.workerinput[WORKER_INPUT_KEY] = str(node.config.stash[LOCK_DIR])


def pytest_unconfigure(config: pytest.Config) -> None:
    """The process that made the lock directory removes it."""
    if not hasattr(config, "workerinput") and LOCK_DIR in config.stash:
        shutil.rmtree(config.stash[LOCK_DIR], ignore_errors=True)


@contextlib.contextmanager
def running(directory: Path, *, alone: bool) -> Iterator[None]:
    """Hold the run's lock while a test runs: shared, or exclusive for an `alone` test."""
    with open(directory / "turnstile", "a") as turnstile, open(directory / "running", "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield  # closing the files releases what is still held


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Run the test's setup, call and teardown under the lock."""
    with running(item.config.stash[LOCK_DIR], alone=item.get_closest_marker("alone") is not None):
        return (yield)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put the `alone` tests first: run before the others start, they wait for no long test to end."""
    items.sort(key=lambda item: item.get_closest_marker("alone") is None)
