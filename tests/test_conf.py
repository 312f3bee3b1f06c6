"""Every queue setting tasks_app reads has one default, the same in apps.py and scheduler_site."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tasks_app.apps import DEFAULTS

ROOT = Path(__file__).resolve().parent.parent
READ = re.compile(r"\bsettings\.((?:REDIS|TASKS?)_[A-Z0-9_]+)")


def test_every_queue_setting_tasks_app_reads_has_a_default():
    read = {name for path in (ROOT / "tasks_app").rglob("*.py") for name in READ.findall(path.read_text())}
    assert read, "no settings found: the pattern is out of date"
    assert read <= DEFAULTS.keys(), f"no default in tasks_app/apps.py for {sorted(read - DEFAULTS.keys())}"


def test_scheduler_site_defaults_are_those_of_conf():
    env = {name: value for name, value in os.environ.items() if name not in DEFAULTS}
    dump = "import json, scheduler_site.settings as s; print(json.dumps({n: getattr(s, n) for n in %r}))"
    out = subprocess.run(
        [sys.executable, "-c", dump % sorted(DEFAULTS)], cwd=ROOT, env=env, check=True, capture_output=True, text=True
    ).stdout
    assert json.loads(out) == DEFAULTS
