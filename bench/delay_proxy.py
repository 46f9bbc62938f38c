"""A TCP forwarder that delays every chunk by a fixed time in each direction: a far database.

    python -m bench.delay_proxy --target 5432 [--delay-ms 0.5]

It prints ``listening on <port>`` once it accepts connections, and forwards each one to
``127.0.0.1:<target>`` until it is terminated. Each direction of each connection has a
reader thread, which stamps every chunk it receives with "now + delay", and a writer
thread, which sends the chunks in the order they came, each no earlier than its stamp: a
0.5 ms delay is a 1 ms longer round trip, without limiting bandwidth or reordering bytes.

The benchmarks use it where ``tc qdisc ... netem`` is not available (no ``sch_netem``
module in a container's kernel). It runs as a process of its own so that its threads never
compete for the GIL with the clients being measured; ``time.sleep`` (not an event loop,
whose epoll timeouts are whole milliseconds) keeps sub-millisecond delays close.
"""

from __future__ import annotations

import argparse
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

CHUNK = 65536


def _nodelay(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _read(
    source: socket.socket, pending: queue.SimpleQueue[tuple[float, bytes]], delay: float
) -> None:
    """Stamp each chunk with when it may go on; an empty chunk says the source closed."""
    data = b"x"
    while data:
        try:
            data = source.recv(CHUNK)
        except OSError:
            data = b""
        pending.put((time.perf_counter() + delay, data))


def _write(
    pending: queue.SimpleQueue[tuple[float, bytes]], sink: socket.socket, source: socket.socket
) -> None:
    """Send each chunk once its time has come, in order; pass a close on."""
    while True:
        due, data = pending.get()
        wait = due - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        if not data:
            break
        try:
            sink.sendall(data)
        except OSError:
            break
    with suppress(OSError):
        sink.shutdown(socket.SHUT_WR)
    with suppress(OSError):
        source.shutdown(socket.SHUT_RD)


def _forward(client: socket.socket, target: int, delay: float) -> None:
    try:
        server = socket.create_connection(("127.0.0.1", target), timeout=5)
    except OSError:
        client.close()  # the client sees the server refuse, as it would directly
        return
    server.settimeout(None)
    for sock in (client, server):
        _nodelay(sock)
    threads = []
    for source, sink in ((client, server), (server, client)):
        pending: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()
        threads += [
            threading.Thread(target=_read, args=(source, pending, delay), daemon=True),
            threading.Thread(target=_write, args=(pending, sink, source), daemon=True),
        ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    client.close()
    server.close()


def serve(target: int, delay: float, port: int = 0) -> None:
    """Accept on ``127.0.0.1:port`` (0: any free port) forever, forwarding to ``target``."""
    listener = socket.create_server(("127.0.0.1", port))
    print(f"listening on {listener.getsockname()[1]}", flush=True)
    while True:
        client, _ = listener.accept()
        threading.Thread(target=_forward, args=(client, target, delay), daemon=True).start()


@contextmanager
def delay_proxy(target: int, delay_ms: float = 0.5) -> Iterator[int]:
    """A proxy process in front of ``127.0.0.1:target``; yields its port, stops it after."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.delay_proxy",
            "--target",
            str(target),
            "--delay-ms",
            str(delay_ms),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = process.stdout.readline() if process.stdout else ""
        if not line.startswith("listening on "):
            raise RuntimeError(f"the delay proxy did not start: {line!r}")
        yield int(line.split()[-1])
    finally:
        process.terminate()
        process.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=int, required=True, help="port on 127.0.0.1")
    parser.add_argument("--delay-ms", type=float, default=0.5, help="per direction (0.5)")
    parser.add_argument("--port", type=int, default=0, help="listening port (0: any free)")
    args = parser.parse_args()
    with suppress(KeyboardInterrupt):
        serve(args.target, args.delay_ms / 1000, args.port)


if __name__ == "__main__":
    main()
