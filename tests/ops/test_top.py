"""``checkpointq top`` driven in a pseudo-terminal against a live system, its screen read
through a terminal emulator (pyte), the way a person would see it."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import pyte
import pytest

from checkpointq.worker.ops import top as top_module
from tests.ops.conftest import System
from tests.support.celery_processes import REPO
from tests.support.checkpoints import make_checkpoint
from tests.support.servers import SilentListener, free_port, wait_until

COLUMNS, ROWS = 120, 60
#: Seconds from Ctrl-C to exit that fail a test. The goal is well under a second (0.4 s
#: measured with every core busy); this bound leaves room for a machine loaded further (the
#: suite's other pytest-xdist worker beside the hogs: 2.5 s was once exceeded there).
STOPS_WITHIN = 5.0
#: The broker probe's socket timeout in the Ctrl-C tests, twice ``STOPS_WITHIN``: a Ctrl-C
#: that waited for a stopped or silent broker to time out still fails them.
PROBE_TIMEOUT = 2 * STOPS_WITHIN
#: ``python -m checkpointq.worker.cli ARGS`` with the probe's timeout (argv[1]) set first.
WITH_PROBE_TIMEOUT = """
import runpy, sys
from checkpointq.worker.ops import broker_probe
broker_probe.PROBE_TIMEOUT = float(sys.argv.pop(1))
runpy.run_module("checkpointq.worker.cli", run_name="__main__", alter_sys=True)
"""


class Terminal:
    """A program on a pseudo-terminal, and the screen it draws."""

    def __init__(
        self, args: list[str], env: dict[str, str], columns: int = COLUMNS, rows: int = ROWS
    ) -> None:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
        self.process = subprocess.Popen(
            args,
            cwd=REPO,
            env={**env, "TERM": "xterm-256color", "COLUMNS": str(columns), "LINES": str(rows)},
            stdin=slave,
            stdout=slave,
            stderr=slave,
            start_new_session=True,
        )
        #: The terminal device, opened again to fill it (``stall``) and to read its modes.
        self.path = os.ttyname(slave)
        os.close(slave)
        self.master = master
        self.screen = pyte.Screen(columns, rows)
        self.stream = pyte.ByteStream(self.screen)

    def lines(self) -> list[str]:
        return [line.rstrip() for line in self.screen.display]

    def wait_for(self, seen: Callable[[list[str]], bool], timeout: float, what: str) -> list[str]:
        """Read output until the screen satisfies ``seen``; fail after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if seen(self.lines()):
                return self.lines()
            ready, _, _ = select.select([self.master], [], [], 0.1)
            if ready:
                try:
                    self.stream.feed(os.read(self.master, 65536))
                except OSError:  # the program exited and closed the terminal
                    break
        screen = "\n".join(self.lines())
        raise AssertionError(f"the screen never showed {what} within {timeout}s:\n{screen}")

    def stall(self) -> None:
        """Stop taking the program's output, as a terminal that is slow or stopped: this
        one reads nothing until ``finish`` and fills what it still buffers (with NULs,
        which draw nothing), so that the program's next write waits."""
        filler = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY)
        try:
            while True:
                os.write(filler, b"\0" * 1024)
        except BlockingIOError:
            pass  # full
        finally:
            os.close(filler)

    def interrupt(self) -> int:
        """Ctrl-C, as a person would stop it, with the terminal not read meanwhile; the exit
        code. Fails unless the program exits within ``STOPS_WITHIN`` seconds."""
        started = time.monotonic()
        self.process.send_signal(signal.SIGINT)
        try:
            code = self.process.wait(timeout=STOPS_WITHIN)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running {STOPS_WITHIN} s after Ctrl-C") from None
        print(f"exited {time.monotonic() - started:.2f} s after Ctrl-C")
        return code

    def finish(self) -> list[Any]:
        """Once the program exited: draw all it wrote, and return the terminal's modes as
        it left them (``termios.tcgetattr``)."""
        device = os.open(self.path, os.O_RDWR | os.O_NOCTTY)
        try:
            modes = termios.tcgetattr(device)
        finally:
            os.close(device)
        # With every end of the terminal closed, reads return what is left, then fail.
        while select.select([self.master], [], [], 10)[0]:
            try:
                data = os.read(self.master, 65536)
            except OSError:
                return modes
            self.stream.feed(data)
        raise AssertionError("the terminal is still held open after the program exited")


def top(
    system: System, columns: int = COLUMNS, rows: int = ROWS
) -> AbstractContextManager[Terminal]:
    return top_on(system.env(), columns, rows)


@contextmanager
def top_on(
    env: dict[str, str],
    columns: int = COLUMNS,
    rows: int = ROWS,
    *,
    probe_timeout: float | None = None,
) -> Iterator[Terminal]:
    """``checkpointq top`` with ``env``, refreshing every 0.2 s (its broker probe timing out
    after ``probe_timeout`` seconds, if given); killed after if still alive."""
    program = ["-m", "checkpointq.worker.cli"]
    if probe_timeout is not None:
        program = ["-c", WITH_PROBE_TIMEOUT, str(probe_timeout)]
    terminal = Terminal([sys.executable, *program, "top", "--interval", "0.2"], env, columns, rows)
    try:
        yield terminal
    finally:
        if terminal.process.poll() is None:
            terminal.process.kill()
            terminal.process.wait()
        os.close(terminal.master)


def _holds(words: list[str], expected: list[str]) -> bool:
    return any(words[i : i + len(expected)] == expected for i in range(len(words)))


def row(*expected: str) -> Callable[[list[str]], bool]:
    """Whether some line shows these cells side by side (tables are drawn without borders,
    two may stand side by side)."""
    return lambda lines: any(_holds(line.split(), list(expected)) for line in lines)


def total(task: str, outcome: str, count: int) -> Callable[[list[str]], bool]:
    """Whether the throughput table shows ``count`` requests in all for task and outcome."""

    def shown(lines: list[str]) -> bool:
        rows = [line.split() for line in lines]
        return any(r[:2] == [task, outcome] and r[3:4] == [str(count)] for r in rows)

    return shown


def field(name: str, shown: str) -> Callable[[list[str]], bool]:
    """Whether a ``name  value`` pair (two pairs share a line) shows ``shown``."""
    return lambda lines: any(_holds(line.split(), [*name.split(), shown]) for line in lines)


def all_of(*checks: Callable[[list[str]], bool]) -> Callable[[list[str]], bool]:
    return lambda lines: all(check(lines) for check in checks)


def test_top_shows_real_throughput_queue_and_dead_letters_of_a_live_system(
    system: System,
) -> None:
    # Given a live worker that applied 4 saves and 1 delete, and refused 2 poison messages
    system.start_worker()
    with system.client() as client:
        handles = [client.save(make_checkpoint(f"top-{i}")) for i in range(4)]
        # (the delete follows its save's application: two pool processes could otherwise
        # apply it first, making that save stale)
        client.wait_durable(handles[0], timeout=30)
        handles.append(client.delete("top-0"))
        client.send("checkpoint.save", [{"sessionId": "", "version": 1}], {})
        client.send("checkpoint.frobnicate", [], {})
        for handle in handles:
            client.wait_durable(handle, timeout=30)
    system.wait_drained()

    with top(system) as terminal:
        # When top runs, it shows those numbers: totals by task and outcome ...
        terminal.wait_for(
            all_of(
                total("save", "applied", 4),
                total("delete", "deleted", 1),
                total("save", "dead_lettered", 1),
                total("other", "dead_lettered", 1),
                # ... dead letters by reason, and the state in Redis
                row("invalid_input", "1"),
                row("unknown_task", "1"),
                field("dead letters", "2"),
                field("live sessions", "3"),
                field("queue depth", "0"),
                field("workers", "1"),
            ),
            timeout=30,
            what="the load's totals",
        )

        # When the worker stops and 4 saves wait in the queue
        system.stop_worker()
        with system.client() as client:
            for i in range(4):
                client.save(make_checkpoint(f"queued-{i}"))

        # Then top shows them queued, the oldest one's age, and no live worker
        lines = terminal.wait_for(
            all_of(field("queue depth", "4"), field("workers", "0")),
            timeout=30,
            what="the queued requests",
        )
        (oldest,) = [line for line in lines if "oldest queued" in line]
        assert oldest.split("oldest queued")[1].split() != ["-"]  # e.g. "oldest queued  350 ms"

        # And Ctrl-C stops it cleanly
        assert terminal.interrupt() == 0


@contextmanager
def broker(system: System, behaviour: str) -> Iterator[tuple[dict[str, str], Callable[[], bool]]]:
    """``top``'s environment with a broker that is ``answering``, ``stopped`` (SIGSTOP: the
    kernel still accepts connections, nothing answers) or ``silent`` (a listener that never
    answers), and whether top waits on it by now: as ``(env, waiting)``."""
    if behaviour == "silent":
        with SilentListener() as silent:
            yield (
                {**system.env(), "CHECKPOINTQ_BROKER_URL": silent.url},
                lambda: silent.accepted > 0,
            )
        return
    assert system.broker.process is not None
    if behaviour == "stopped":
        system.broker.process.send_signal(signal.SIGSTOP)
    try:
        yield system.env(), lambda: True
    finally:
        system.broker.process.send_signal(signal.SIGCONT)


@pytest.mark.parametrize("output", ["read", "stalled"])
@pytest.mark.parametrize("behaviour", ["answering", "stopped", "silent"])
def test_ctrl_c_ends_top_at_once_whatever_it_waits_on(
    system: System, cpu_hogs: int, behaviour: str, output: str
) -> None:
    # Given every core busy, and top running on a broker that answers, or not at all
    with (
        broker(system, behaviour) as (env, waiting),
        top_on(env, probe_timeout=PROBE_TIMEOUT) as terminal,
    ):
        if behaviour == "silent":
            # (waiting on its first answer: nothing is drawn before it)
            wait_until(waiting, timeout=30, message="top to connect to the broker")
        else:
            shown = "queue depth" if behaviour == "answering" else "unreachable"
            terminal.wait_for(lambda lines: any(shown in line for line in lines), 30, shown)
        # And a terminal that reads top's output, or has stopped taking it
        if output == "stalled":
            terminal.stall()

        # When Ctrl-C is pressed, Then top exits at once, with status 0
        assert terminal.interrupt() == 0

        # And the terminal is as top found it: the cursor shown, lines and echo back on
        modes = terminal.finish()
        assert not terminal.screen.cursor.hidden
        assert modes[3] & termios.ICANON and modes[3] & termios.ECHO


@pytest.mark.parametrize("output", ["read", "stalled"])
def test_a_wind_down_cut_short_still_shows_the_cursor(output: str) -> None:
    # Given a terminal whose cursor a view hid, that has taken nothing since, or is full
    master, slave = pty.openpty()
    try:
        os.write(slave, b"\x1b[?25l")
        if output == "stalled":
            os.set_blocking(slave, False)
            with contextlib.suppress(BlockingIOError):
                while True:
                    os.write(slave, b"\0" * 1024)
            os.set_blocking(slave, True)
        # When top leaves without its own "show the cursor" reaching it
        with os.fdopen(os.dup(slave), "w") as output_file:
            top_module._show_cursor(output_file)
        # Then the terminal shows the cursor, at once, without being read first
        os.close(slave)
        slave = -1
        screen = pyte.Screen(COLUMNS, ROWS)
        stream = pyte.ByteStream(screen)
        with contextlib.suppress(OSError):
            while select.select([master], [], [], 1)[0]:
                stream.feed(os.read(master, 65536))
        assert not screen.cursor.hidden
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)


def test_stats_shows_the_numbers_top_shows(system: System) -> None:
    # Given a worker that applied 2 saves
    system.start_worker()
    with system.client() as client:
        for handle in [client.save(make_checkpoint(f"stats-{i}")) for i in range(2)]:
            client.wait_durable(handle, timeout=30)

    # Then stats reports them, from the same snapshot top draws: the totals, the sessions
    # and the live worker in one report. (One report: the worker counts as live while its
    # last heartbeat lives, 1.5 s here, so a later report on a loaded machine may fall in a
    # late beat's gap and show none.)
    def reported() -> bool:
        result = system.cli("stats")
        return (
            result.returncode == 0
            and "requests save:applied  2" in result.stdout
            and "live_sessions          2" in result.stdout
            and "workers                1" in result.stdout
        )

    wait_until(reported, timeout=30, message="stats to report the saves, sessions and worker")


def test_top_fits_80_by_24_says_q_quits_and_quits_on_q(system: System) -> None:
    # Given a live worker that applied saves, deletes and refused one message
    system.start_worker()
    with system.client() as client:
        handles = [client.save(make_checkpoint(f"small-{i}")) for i in range(3)]
        client.wait_durable(handles[0], timeout=30)  # (as above: the delete comes after)
        handles.append(client.delete("small-0"))
        client.send("checkpoint.frobnicate", [], {})
        for handle in handles:
            client.wait_durable(handle, timeout=30)
    system.wait_drained()

    with top(system, columns=80, rows=24) as terminal:
        # When top runs in an 80x24 terminal, every part is on the screen at once: the quit
        # key, the state, the throughput table, dead letters by reason and the worker row
        lines = terminal.wait_for(
            all_of(
                lambda lines: "q: quit" in lines[0],
                total("save", "applied", 3),
                row("unknown_task", "1"),
                field("workers", "1"),
                lambda lines: any("@" in line for line in lines[1:]),  # the worker's row
            ),
            timeout=30,
            what="the whole view within 80x24",
        )
        assert all(len(line) <= 80 for line in lines)
        assert any("queue depth" in line for line in lines)
        # and each panel's title on one line of its own, not wrapped into its neighbour
        for title in ("refused, by reason", "workers", "throughput (live workers)"):
            assert any(title in line for line in lines), (title, lines)

        # When q is pressed, Then top exits cleanly
        os.write(terminal.master, b"q")
        assert terminal.process.wait(timeout=10) == 0


def test_top_once_exits_1_when_the_broker_cannot_be_read(system: System) -> None:
    env = {**system.env(), "CHECKPOINTQ_BROKER_URL": f"redis://127.0.0.1:{free_port()}/0"}
    done = subprocess.run(
        [sys.executable, "-m", "checkpointq.worker.cli", "top", "--once"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "unreachable" in done.stdout + done.stderr


def test_a_panel_title_longer_than_its_columns_stays_on_one_line() -> None:
    # Given the dead letters' table with one short reason (narrower than its title),
    # When it is drawn at 80 columns, Then its title is one line, not wrapped in two.
    from rich.console import Console

    from checkpointq.worker.ops.top import _table

    table = _table("refused, by reason", "reason", "total")
    table.add_row("bad", "1")
    console = Console(width=80, record=True, color_system=None)
    console.print(table)
    assert "refused, by reason" in console.export_text()
