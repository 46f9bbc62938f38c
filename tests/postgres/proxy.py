"""A TCP proxy on a free loopback port whose target a test moves: the one address a worker
knows stays put while the server behind it changes (a failover to a standby), as a
virtual IP or a connection pooler does in a deployment."""

from __future__ import annotations

import selectors
import socket
import threading
from contextlib import suppress

from tests.support.servers import free_port


class Proxy:
    """Forwards each connection to ``127.0.0.1:target``; ``retarget`` moves new
    connections elsewhere and ``drop_all`` cuts the open ones (both ends see a reset)."""

    def __init__(self, target: int) -> None:
        self.port = free_port()
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def retarget(self, target: int) -> None:
        self.target = target

    def drop_all(self) -> int:
        """Cut every open connection; how many there were."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            for sock in pair:
                _close(sock)
        return len(pairs)

    def close(self) -> None:
        self._closed.set()
        _close(self._listener)
        self.drop_all()
        self._thread.join(timeout=5)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                server = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            except OSError:
                _close(client)  # the client sees the server refuse, as it would directly
                continue
            server.settimeout(None)
            with self._lock:
                self._pairs.append((client, server))
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()

    def _pump(self, client: socket.socket, server: socket.socket) -> None:
        selector = selectors.DefaultSelector()
        with suppress(OSError, ValueError):
            selector.register(client, selectors.EVENT_READ, server)
            selector.register(server, selectors.EVENT_READ, client)
            while True:
                for key, _ in selector.select():
                    source: socket.socket = key.fileobj  # type: ignore[assignment]
                    data = source.recv(65536)
                    if not data:
                        raise OSError("closed")
                    key.data.sendall(data)
        selector.close()
        _close(client)
        _close(server)
        with self._lock:
            if (client, server) in self._pairs:
                self._pairs.remove((client, server))


def _close(sock: socket.socket) -> None:
    with suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with suppress(OSError):
        sock.close()
