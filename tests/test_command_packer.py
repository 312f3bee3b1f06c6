"""The command packer: what redis-py's hiredis packer sends, byte for byte, and the same errors."""

import pytest
from django.conf import settings
from redis.connection import HiredisRespSerializer
from redis.exceptions import DataError

from tasks_app.protocol.scripts import CommandPacker, connect

COMMANDS = [
    ("EVALSHA", "a" * 40, 2, "key:1", b"key:\xff", 3, 1.5, -7, "", b"", "\u00e9t\u00e9", b"\x00\x01"),
    ("GET", bytearray(b"held")),
    ("SET", memoryview(b"k"), b"v"),
    ("SCRIPT LOAD", "return 1"),
    ("CLIENT SETNAME", "x"),
    (b"PING",),
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda command: repr(command[0]))
def test_commands_are_packed_as_redis_py_packs_them(command):
    assert CommandPacker().pack(*command) == list(HiredisRespSerializer().pack(*command))


@pytest.mark.parametrize("bad", [True, None, object()])
def test_an_argument_redis_cannot_take_is_refused_as_redis_py_refuses_it(bad):
    with pytest.raises(DataError):
        CommandPacker().pack("SET", "k", bad)


def test_connections_pack_with_it(broker):
    client = connect(settings.REDIS_URL)
    try:
        assert isinstance(client.connection_pool.get_connection()._command_packer, CommandPacker)
        assert client.echo(b"\xff\x00") == b"\xff\x00"
    finally:
        client.close()
