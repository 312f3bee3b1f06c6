"""Headless Debian Chromium driven by Playwright's sync API, with screenshots in test-artifacts/."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import ARTIFACTS_DIR

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"]


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    """One headless Chromium for the tests of a module; skipped when Debian's chromium is not installed."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing (install Debian's chromium package to run browser tests)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with pytest.MonkeyPatch.context() as monkeypatch:
        # Playwright's sync API keeps an event loop in this thread while the browser is up; the ORM
        # calls the tests and their fixtures make between browser steps are plain synchronous calls.
        monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
        with sync_api.sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
            try:
                yield browser
            finally:
                browser.close()


@pytest.fixture
def page(request: pytest.FixtureRequest, browser: object) -> Iterator[object]:
    """A fresh page in a browser context of this test's own (no cookies or storage of another test)."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})  # type: ignore[attr-defined]
    context.set_default_timeout(15_000)
    page = context.new_page()
    try:
        yield page
    finally:
        if getattr(request.node, "rep_call_failed", False):
            page.screenshot(path=str(screenshot_path(request.node.name, "failure")), full_page=True)
        context.close()


def screenshot_path(test_name: str, step: str) -> Path:
    """Where a test's screenshot of `step` goes (test-artifacts/ is not committed)."""
    ARTIFACTS_DIR.mkdir(exist_ok=True)
    return ARTIFACTS_DIR / f"{test_name}-{step}.png"


@pytest.fixture
def snap(request: pytest.FixtureRequest, page: object) -> Callable[[str], Path]:
    """Save a full-page screenshot of the current page as test-artifacts/<test>-<step>.png."""

    def take(step: str) -> Path:
        path = screenshot_path(request.node.name, step)
        page.screenshot(path=str(path), full_page=True)  # type: ignore[attr-defined]
        return path

    return take


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """Remember a failed call so the page fixture can screenshot it."""
    report = yield
    if report.when == "call" and report.failed:
        item.rep_call_failed = True  # type: ignore[attr-defined]
    return report
