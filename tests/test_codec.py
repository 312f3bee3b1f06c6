"""The protobuf contract and the JSON payload."""

import filecmp
import json
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf.internal.encoder import _VarintBytes

from tasks_app.protocol.codec import (
    Task,
    UndecodableTask,
    decode_payload,
    decode_task,
    encode_arguments,
    encode_task,
    payload_of,
)

PROTO_DIR = Path(__file__).resolve().parent.parent / "proto"
GENERATED_DIR = Path(__file__).resolve().parent.parent / "tasks_app"


def test_committed_task_pb2_and_its_stub_match_a_fresh_generation(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            str(PROTO_DIR / "task.proto"),
        ],
        check=True,
    )
    for name in ("task_pb2.py", "task_pb2.pyi"):
        assert filecmp.cmp(tmp_path / name, GENERATED_DIR / name, shallow=False), (
            f"tasks_app/{name} is stale: run `make proto` and commit it"
        )


def test_contract_field_numbers_are_fixed():
    fields = {f.name: f.number for f in Task.DESCRIPTOR.fields}
    assert Task.DESCRIPTOR.full_name == "scheduler.v1.Task"
    assert {k: fields[k] for k in ("id", "type", "payload", "queue", "priority")} == {
        "id": 1,
        "type": 2,
        "payload": 3,
        "queue": 4,
        "priority": 5,
    }


def test_unknown_fields_from_a_newer_producer_survive_a_re_encode():
    task = Task(id="t1", type="demo.echo", queue="default", attempt=1)
    # Field 99, length-delimited, as a newer producer would write it.
    unknown = _VarintBytes((99 << 3) | 2) + _VarintBytes(5) + b"hello"
    decoded = decode_task(encode_task(task) + unknown)
    decoded.attempt += 1
    decoded.last_error = "builtins.RuntimeError: boom"
    re_encoded = encode_task(decoded)
    assert unknown in re_encoded
    assert decode_task(re_encoded).attempt == 2


def test_appended_fields_override_earlier_ones():
    raw = encode_task(Task(id="t1", type="x", last_error="old"))
    appended = raw + _VarintBytes((11 << 3) | 2) + _VarintBytes(3) + b"new"
    assert decode_task(appended).last_error == "new"


@pytest.mark.parametrize("raw", [b"\xff\xff\xff", b"\x00wake", encode_task(Task(type="no-id"))])
def test_garbage_is_rejected(raw):
    with pytest.raises(UndecodableTask):
        decode_task(raw)


def test_payload_round_trip_and_optional_members():
    assert decode_payload(payload_of(*encode_arguments([1, "a"], {"k": [True, None]}))).kwargs == {"k": [True, None]}
    assert decode_payload(b"").args == []
    assert decode_payload(b"{}").kwargs == {}
    assert payload_of(*encode_arguments([], {})) == b"{}"


@pytest.mark.parametrize(
    ("args", "kwargs"), [([], {}), ([1, "é"], {}), ((), {"k": [True, None]}), ([{"a": 1}], {"b": "\u2603"})]
)
def test_payload_is_the_compact_json_of_its_members(args, kwargs):
    body = {**({"args": list(args)} if args else {}), **({"kwargs": kwargs} if kwargs else {})}
    assert (
        payload_of(*encode_arguments(args, kwargs))
        == json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    )


@pytest.mark.parametrize(("args", "kwargs"), [([float("nan")], {}), ([], {"k": float("inf")})])
def test_payload_refuses_nan(args, kwargs):
    with pytest.raises(ValueError, match="Out of range float values"):
        payload_of(*encode_arguments(args, kwargs))


def test_payload_refuses_a_lone_surrogate():
    with pytest.raises(UnicodeEncodeError):
        payload_of(*encode_arguments(["\ud800"], {}))


@pytest.mark.parametrize("payload", [b"[1]", b'{"args": {}}', b'{"kwargs": []}', b"\xff", b"{"])
def test_malformed_payloads_are_rejected(payload):
    with pytest.raises(UndecodableTask):
        decode_payload(payload)
