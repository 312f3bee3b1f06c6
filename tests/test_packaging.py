"""The wheel: what it holds, the dependencies it declares, and a startproject site running tasks from it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from django.conf import settings
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tasks_app.protocol.broker import Broker

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "lua", "tasks_app")  # what `pip wheel .` reads
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

HANDLERS = """from tasks_app import handler


@handler("shop.add")
def add(a: int, b: int) -> int:
    return a + b
"""
# One worker builds the wheel and the virtualenv once for every test of the module.
pytestmark = pytest.mark.xdist_group("packaging")

URLPATTERNS = 'urlpatterns = [\n    path("", include("tasks_app.urls")),'


def _run(*command: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [str(part) for part in command], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from a copy of the sources (the checkout gets no build/ or egg-info)."""
    source, dist = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("dist")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(
                ROOT / name, source / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
            )
        else:
            shutil.copy2(ROOT / name, source / name)
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", dist, source)
    (built,) = dist.glob("*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv holding the wheel and the dependencies it declares, nothing else."""
    path = tmp_path_factory.mktemp("venv")
    _run(sys.executable, "-m", "venv", "--without-pip", path)
    _run(sys.executable, "-m", "pip", "--python", path / "bin" / "python", "install", "-q", wheel)
    return path


def _package_files() -> set[str]:
    """Every file of tasks_app/ in the checkout (tasks_app/lua followed to lua/), as wheel paths."""
    files = set()
    for directory, _, names in os.walk(ROOT / "tasks_app", followlinks=True):
        relative = Path(directory).relative_to(ROOT)
        if "__pycache__" not in relative.parts:
            files |= {(relative / name).as_posix() for name in names if not name.endswith(".pyc")}
    return files


def test_the_wheel_holds_all_of_tasks_app_and_nothing_else(wheel):
    names = {name for name in zipfile.ZipFile(wheel).namelist() if ".dist-info/" not in name}
    lua = {f"tasks_app/{path.relative_to(ROOT).as_posix()}" for path in (ROOT / "lua").rglob("*.lua")}
    assert {
        "tasks_app/lua/include/protobuf.lua",
        "tasks_app/py.typed",
        "tasks_app/task_pb2.pyi",
        "tasks_app/migrations/0001_initial.py",
        "tasks_app/templates/tasks_app/base.html",
    } <= lua | names
    assert lua <= names
    assert names == _package_files()


def test_runtime_dependencies_and_extras_hold_the_pins_of_requirements_txt():
    pins = dict(re.findall(r"^([A-Za-z0-9_.\[\]-]+)==(\S+)$", (ROOT / "requirements.txt").read_text(), re.M))
    pins = {canonicalize_name(name.split("[")[0]): version for name, version in pins.items()}
    assert PYPROJECT["project"]["requires-python"] == ">=3.12"
    extras = PYPROJECT["project"]["optional-dependencies"].values()
    for dependency in map(
        Requirement, [*PYPROJECT["project"]["dependencies"], *(d for extra in extras for d in extra)]
    ):
        pin = pins.get(canonicalize_name(dependency.name))
        assert pin is not None, f"{dependency.name} is not pinned in requirements.txt"
        assert dependency.specifier.contains(pin), f"{dependency} does not allow requirements.txt's {pin}"


def test_protobuf_floor_is_the_version_task_pb2_was_generated_by():
    gencode = (ROOT / "tasks_app" / "task_pb2.py").read_text()
    generated = re.search(r"^# Protobuf Python Version: (\S+)$", gencode, re.M)
    protobuf = next(
        Requirement(dependency)
        for dependency in PYPROJECT["project"]["dependencies"]
        if Requirement(dependency).name == "protobuf"
    )
    assert generated and f">={generated[1]}" in {str(spec) for spec in protobuf.specifier}


def _start_project(venv: Path, site: Path, key_prefix: str) -> dict[str, str]:
    """Make a site as its docs tell a user to: startproject, startapp, settings, urls, a handler."""
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in {"DJANGO_SETTINGS_MODULE", "PYTHONPATH"} and not name.startswith(("TASK", "REDIS"))
    }
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    _run(venv / "bin" / "django-admin", "startproject", "mysite", site, env=env)
    _run(venv / "bin" / "python", "manage.py", "startapp", "shop", cwd=site, env=env)
    (site / "shop" / "handlers.py").write_text(HANDLERS)
    with (site / "mysite" / "settings.py").open("a") as settings_file:
        settings_file.write(
            f'\nINSTALLED_APPS += ["tasks_app", "shop"]\nREDIS_URL = "{settings.REDIS_URL}"\n'
            f'TASKS_KEY_PREFIX = "{key_prefix}"\n'
        )
    urls = (site / "mysite" / "urls.py").read_text().replace("import path", "import include, path")
    (site / "mysite" / "urls.py").write_text(urls.replace("urlpatterns = [", URLPATTERNS))
    return env


def test_a_startproject_site_enqueues_and_runs_a_task_with_the_installed_app(
    venv, tmp_path, broker: Broker, key_prefix
):
    site = tmp_path / "mysite"
    env = _start_project(venv, site, key_prefix)
    manage = (venv / "bin" / "python", "manage.py")
    _run(*manage, "migrate", "-v", "0", cwd=site, env=env)
    where = _run(
        *manage,
        "shell",
        "-v",
        "0",
        "-c",
        "import tasks_app, tasks_app.protocol.scripts as b; from django.urls import reverse; "
        "print(tasks_app.__file__, b.LUA_DIR, reverse('tasks_app:dashboard'))",
        cwd=site,
        env=env,
    )
    assert where.split()[0].startswith(str(venv)) and where.split()[1].startswith(str(venv)), where
    assert where.split()[2] == "/tasks/dashboard/"
    (task_id,) = _run(*manage, "enqueue", "shop.add", "--args", "[2, 3]", cwd=site, env=env).split()
    _run(*manage, "runconsumer", "--burst", cwd=site, env=env)
    record = broker.records.get_result(task_id)
    assert record is not None and record["status"] == "SUCCESSFUL", record
    assert record["return_value"] == "5"
