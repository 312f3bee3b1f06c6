"""A TCP proxy in front of Redis that can cut connections or swallow one reply, for network-failure tests."""

from __future__ import annotations

import contextlib
import socket
import threading

# What Redis answers when a blocking move timed out (RESP2 / RESP3): it moved nothing.
NULL_REPLIES = (b"*-1\r\n", b"_\r\n", b"$-1\r\n")


class RedisProxy:
    """Forwards to a Redis port on loopback.

    `drop_reply_to`: the first command containing these bytes is forwarded, then the connection
    is closed instead of passing its (non-null) reply on: the command ran, the client never hears
    of it (a network cut or a node dying mid-reply). `cut()`: every connection fails until `restore()`.
    `freeze()`: commands are held, unanswered, until `thaw()` (a frozen server, a black-holed network).
    """

    def __init__(self, port: int, drop_reply_to: bytes | None = None) -> None:
        self.target_port = port
        self.marker = drop_reply_to
        self.dropped = threading.Event()
        self._cut = threading.Event()
        self._flowing = threading.Event()
        self._flowing.set()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def cut(self) -> None:
        """Fail every open connection and every new one until `restore()`."""
        self._cut.set()
        for sock in list(self._sockets):
            _close(sock)

    def restore(self) -> None:
        """Forward again."""
        self._cut.clear()

    def freeze(self) -> None:
        """Hold every command sent from now on, unanswered, until `thaw()`."""
        self._flowing.clear()

    def thaw(self) -> None:
        """Pass the held commands on, and forward again."""
        self._flowing.set()

    def close(self) -> None:
        self._listener.close()
        self.cut()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._cut.is_set():
                _close(client)
                continue
            server = socket.create_connection(("127.0.0.1", self.target_port))
            self._sockets += [client, server]
            armed = threading.Event()
            threading.Thread(target=self._upstream, args=(client, server, armed), daemon=True).start()
            threading.Thread(target=self._downstream, args=(server, client, armed), daemon=True).start()

    def _upstream(self, client: socket.socket, server: socket.socket, armed: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while chunk := client.recv(65536):
                if self.marker and not self.dropped.is_set() and self.marker in chunk:
                    armed.set()
                self._flowing.wait()
                server.sendall(chunk)

    def _downstream(self, server: socket.socket, client: socket.socket, armed: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while chunk := server.recv(65536):
                if armed.is_set() and chunk in NULL_REPLIES:
                    armed.clear()  # a blocking move that timed out moved nothing: wait for one that does
                elif armed.is_set() and not self.dropped.is_set():
                    self.dropped.set()
                    break  # the reply is swallowed
                client.sendall(chunk)
        _close(client)
        _close(server)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
