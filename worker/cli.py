"""``checkpointq``: run the system, enqueue requests, inspect the store and the dead letters.

Every command reads its configuration from ``CHECKPOINTQ_*`` variables (or ``.env``); with
no broker URL, commands use the embedded Redis that ``checkpointq up`` runs under the data
directory. Output is for people by default and JSON with ``--json``. An expected failure
(bad input, Redis down, nothing running) is one line on stderr and exit code 1, never a
traceback; URLs in messages are shown with their passwords redacted.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime
from typing import IO, Any, TypeVar

import click
import redis
from kombu.exceptions import KombuError
from redis.exceptions import RedisClusterException

from checkpointq.store import encryption
from checkpointq.store.base import Fence
from checkpointq.store.errors import CheckpointError
from checkpointq.store.factory import MissingExtra as MissingDriver
from checkpointq.store.keys import KeySpace
from checkpointq.store.memory import InMemoryStore
from checkpointq.store.model import Checkpoint, display_id
from checkpointq.store.rekey import rekey as rekey_store
from checkpointq.store.serde import checkpoint_from_wire, checkpoint_to_wire, loads_json
from checkpointq.store.urls import (
    is_cluster_url,
    is_redis_url,
    redact_url,
    redact_urls,
    redis_py_url,
)
from checkpointq.tasks.dead_letters import DeadLetter, DeadLetters, Reason
from checkpointq.tasks.errors import NotFound, NotReplayable
from checkpointq.tasks.producer.client import CheckpointClient, Handle
from checkpointq.tasks.producer.outcomes import (
    HISTORY_CAP,
    MAX_VALUE_BYTES,
    SUPERSEDED,
    RequestOutcome,
)
from checkpointq.tasks.sweep import sweep as run_sweep
from checkpointq.worker import connections
from checkpointq.worker.console import EXIT_MISSING_EXTRA, missing_worker_extra, quiet_stdout
from checkpointq.worker.settings import Settings

F = TypeVar("F", bound=Callable[..., Any])

#: Exit code of every failure, usage errors included (click would use 2 for those).
EXIT_FAILURE = 1
#: Sessions expired per sweep call when sweeping by hand (each call is one locked sweep).
SWEEP_BATCH = 1000
#: Dead letters fetched per page when replaying everything.
DLQ_PAGE = 500


class CliFailure(click.ClickException):
    """An expected failure, shown as ``checkpointq: error: ...`` on one line."""

    exit_code = EXIT_FAILURE

    def show(self, file: IO[Any] | None = None) -> None:
        line = " ".join(redact_urls(self.format_message()).split())
        click.echo(f"checkpointq: error: {line}", err=True)


class _HelpFailure(click.ClickException):
    """A group called without a command: its help on stderr, and exit 1."""

    exit_code = EXIT_FAILURE

    def __init__(self, ctx: click.Context | None) -> None:
        super().__init__("no command given")
        self.ctx = ctx

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(self.ctx.get_help() if self.ctx is not None else self.message, err=True)


class MissingExtra(CliFailure):
    """A command whose dependencies are missing: the line names the extra, exit status 2."""

    exit_code = EXIT_MISSING_EXTRA


def _usage_failure(exc: click.UsageError) -> CliFailure:
    """A usage error (unknown option, missing argument, bad value) as one line, exit 1."""
    where = exc.ctx.command_path if exc.ctx is not None else "checkpointq"
    return CliFailure(f"{exc.format_message().rstrip('.')} (see `{where} --help`)")


class _Cli(click.Group):
    """The command group: converts expected exceptions, usage errors included, into
    one-line failures with exit code 1."""

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.exceptions.NoArgsIsHelpError as exc:
            raise _HelpFailure(exc.ctx) from None  # `checkpointq` alone: the help, and exit 1
        except click.UsageError as exc:
            raise _usage_failure(exc) from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.exceptions.NoArgsIsHelpError as exc:
            raise _HelpFailure(exc.ctx) from None  # `checkpointq dlq` alone: its help, and exit 1
        except click.UsageError as exc:
            raise _usage_failure(exc) from None
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except BrokenPipeError:
            # The reader went away (`checkpointq ls | head -1`): what it wanted was printed.
            quiet_stdout()
            raise click.exceptions.Exit(0) from None
        except MissingDriver as exc:  # a PostgreSQL store URL without the postgres extra
            raise MissingExtra(str(exc)) from None
        except CheckpointError as exc:
            raise CliFailure(str(exc)) from None
        except (redis.RedisError, RedisClusterException) as exc:
            raise CliFailure(f"Redis: {type(exc).__name__}: {exc}") from None
        except KombuError as exc:
            raise CliFailure(f"broker: {type(exc).__name__}: {exc}") from None
        except OSError as exc:
            raise CliFailure(f"{type(exc).__name__}: {exc}") from None
        except ModuleNotFoundError as exc:  # e.g. `top` beside a Celery installed without rich
            message = missing_worker_extra(exc)
            if message is None:
                raise
            raise MissingExtra(message) from None


def _settings(*, resolve: bool = True, **overrides: Any) -> Settings:
    settings = connections.load_settings(**{k: v for k, v in overrides.items() if v is not None})
    return connections.resolve(settings) if resolve else settings


#: Options of the commands that run the system, as Celery users type them, and the settings
#: each one sets (it wins over the CHECKPOINTQ_ variable).
RUN_OPTIONS = {
    "concurrency": "CHECKPOINTQ_CONCURRENCY",
    "pool": "CHECKPOINTQ_POOL",
    "queue": "CHECKPOINTQ_QUEUE",
    "log_level": "CHECKPOINTQ_LOG_LEVEL",
    "hostname": "CHECKPOINTQ_HOSTNAME",
    "task_events": "CHECKPOINTQ_TASK_EVENTS",
    "include": "CHECKPOINTQ_INCLUDE",
}


def run_options(function: F) -> F:
    """``-c``, ``-P``, ``-Q``, ``-n``, ``-E``, ``-I`` (worker settings) and ``-l``, as
    ``celery worker`` takes them; each overrides its CHECKPOINTQ_ variable."""
    options = [
        click.option(
            "-c",
            "--concurrency",
            type=click.IntRange(min=1),
            metavar="N",
            help="Worker processes (or threads) consuming at once. [CHECKPOINTQ_CONCURRENCY; "
            "default 2]",
        ),
        click.option(
            "-P",
            "--pool",
            type=click.Choice(["prefork", "solo", "threads"]),
            help="How the worker runs tasks: child processes, in its own process, or "
            "threads. [CHECKPOINTQ_POOL; default prefork]",
        ),
        click.option(
            "-Q",
            "--queues",
            "queue",
            metavar="QUEUE",
            help="The queue to consume (one: producers push to it). [CHECKPOINTQ_QUEUE; "
            "default checkpoints]",
        ),
        click.option(
            "-l",
            "--loglevel",
            "log_level",
            type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
            help="Least severe log level shown; DEBUG logs one line per request. "
            "[CHECKPOINTQ_LOG_LEVEL; default INFO]",
        ),
        click.option(
            "-n",
            "--hostname",
            metavar="NAME",
            help="The worker's node name, e.g. w1@%h (%h: this host's name). "
            "[CHECKPOINTQ_HOSTNAME; default celery@<host>]",
        ),
        click.option(
            "-E",
            "--task-events",
            is_flag=True,
            default=None,
            help="Send task events, for Flower and `celery events`. "
            "[CHECKPOINTQ_TASK_EVENTS; default off]",
        ),
        click.option(
            "-I",
            "--include",
            metavar="MODULE[,MODULE]",
            multiple=True,
            help="Import these modules in the worker at start-up (signal handlers, Sentry or "
            "OpenTelemetry set-up); repeatable. [CHECKPOINTQ_INCLUDE; default none]",
        ),
    ]
    for option in reversed(options):
        function = option(function)
    return function


def _run_settings(run: dict[str, Any], as_json: bool, *, resolve: bool = True) -> Settings:
    """Settings for a command that runs the system: its options over the environment."""
    overrides = dict(run)
    modules = [m.strip() for text in overrides.pop("include", None) or () for m in text.split(",")]
    if any(modules):
        overrides["include"] = [m for m in modules if m]
    queue = overrides.get("queue")
    if queue is not None and "," in queue:
        raise CliFailure(f"-Q takes one queue (checkpointq consumes one), not {queue!r}")
    if overrides.get("log_level") is not None:
        overrides["log_level"] = overrides["log_level"].upper()
    if as_json:
        overrides["log_format"] = "json"
    return _settings(resolve=resolve, **overrides)


def _override_env(settings: Settings, run: dict[str, Any], as_json: bool) -> dict[str, str]:
    """The CHECKPOINTQ_ variables a child process needs to get the same overrides."""
    env = {RUN_OPTIONS[name]: _env_value(getattr(settings, name)) for name, v in run.items() if v}
    if as_json:
        env["CHECKPOINTQ_LOG_FORMAT"] = "json"
    return env


def _env_value(value: Any) -> str:
    return ",".join(value) if isinstance(value, list) else str(value)


def run_json_option(function: F) -> F:
    return click.option(
        "--json",
        "as_json",
        is_flag=True,
        help="Log one JSON object per line (CHECKPOINTQ_LOG_FORMAT=json), for log shippers.",
    )(function)


def _hint(text: str) -> None:
    """A line for the person at the terminal, on stderr: never mixed into piped output."""
    click.echo(f"# {text}", err=True)


def _emit(as_json: bool, data: Any, human: Iterable[str]) -> None:
    if as_json:
        click.echo(json.dumps(data, ensure_ascii=False, default=str))
    else:
        for line in human:
            click.echo(line)


def json_option(function: F) -> F:
    return click.option(
        "--json", "as_json", is_flag=True, help="Print JSON for scripts instead of text."
    )(function)


def wait_options(function: F) -> F:
    """``--wait`` and its ``--timeout``, shared by the commands that enqueue a request."""
    function = click.option(
        "--timeout",
        type=click.FloatRange(min=0, min_open=True),
        default=10.0,
        show_default=True,
        metavar="SECONDS",
        help="With --wait: how long to wait for a worker before failing with exit 1 (the "
        "request stays queued and may still be applied).",
    )(function)
    return click.option(
        "--wait",
        is_flag=True,
        help="Return only once a worker has made the request durable in the store "
        "(read-your-writes), instead of as soon as it is enqueued.",
    )(function)


def _configure_logging(settings: Settings) -> None:
    """``up``'s own log lines: text, or JSON objects like its children's; passwords hidden."""
    from checkpointq.worker import logs

    logging.basicConfig(
        level=settings.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logs.apply(logging.getLogger(), settings.log_format)


@click.group(name="checkpointq", cls=_Cli, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="checkpointq", prog_name="checkpointq")
def cli() -> None:
    """Persist AI-agent session checkpoints through Celery workers on Redis.

    Settings come from CHECKPOINTQ_* variables or a .env file (docs/configuration.md). With
    no CHECKPOINTQ_BROKER_URL, every command uses the embedded Redis of a `checkpointq up`
    running in this directory. Errors are one line on stderr with exit 1 (2 when the worker
    extra is missing); --json on every command prints JSON for scripts.
    """


# -- running the system ---------------------------------------------------------------------


@cli.command(short_help="Run worker, beat (and an embedded Redis) in the foreground.")
@run_options
@run_json_option
def up(as_json: bool, **run: Any) -> None:
    """Run everything in the foreground: a worker and beat, and an embedded Redis (unix
    socket and AOF under CHECKPOINTQ_DATA_DIR) when no CHECKPOINTQ_BROKER_URL is set.

    Once the worker consumes, it prints where everything is and how other shells and
    programs reach it. Ctrl-C (or SIGTERM) stops the worker and beat, then the Redis.
    """
    from checkpointq.worker.supervisor import Supervisor  # the embedded Redis etc. only when run

    settings = _run_settings(run, as_json, resolve=False)
    embedded = settings.broker_url is None or settings.found_embedded
    if settings.found_embedded:
        # Another `up` serves this directory: starting ours fails with that message.
        settings = settings.model_copy(update={"broker_url": None})
    _configure_logging(settings)
    where = (
        redact_url(settings.broker_url)
        if settings.broker_url
        else f"embedded Redis under {settings.data_dir.resolve()}"
    )
    if not embedded and settings.broker_url:
        _require_broker(settings.broker_url)
    up_log = logging.getLogger("checkpointq.up")
    up_log.info("starting; broker %s", where)
    Supervisor(
        settings,
        on_ready=lambda running: _ready_block(running, embedded, as_json),
        child_env=_override_env(settings, run, as_json),
    ).run()
    up_log.info("stopped")


def _require_broker(url: str) -> None:
    """Fail in one line naming ``url`` when ``up``'s Redis broker does not answer, before the
    worker and beat start (each would retry it, and the first to give up takes all down)."""
    if not is_redis_url(url) or is_cluster_url(url):
        return  # Sentinel, AMQP, Cluster: the worker's own connect reports them
    client = redis.Redis.from_url(
        redis_py_url(url),
        socket_timeout=connections.CLI_SOCKET_TIMEOUT,
        socket_connect_timeout=connections.CLI_SOCKET_TIMEOUT,
    )
    try:
        client.ping()
    except (redis.RedisError, OSError) as exc:
        raise CliFailure(
            f"cannot reach the broker at {redact_url(url)}: {type(exc).__name__}: {exc}"
        ) from None
    finally:
        client.close()


def _ready_block(settings: Settings, embedded: bool, as_json: bool) -> None:
    """What ``up`` prints once its worker consumes: where the broker and the store are, and
    what another shell must export to reach the same ones (passwords shown as ``***``)."""
    url = redact_url(settings.broker_url or "")
    store_url = redact_url(settings.store_url) if settings.store_url else None
    data = (
        f"{settings.data_dir.resolve()} (embedded Redis, AOF fsynced every second)"
        if embedded
        else "-"
    )
    if as_json:
        ready = {
            "event": "ready",
            "data_dir": str(settings.data_dir.resolve()) if embedded else None,
            "broker_url": url,
            "store_url": store_url or url,
            "queue": settings.queue,
        }
        click.echo(json.dumps(ready), err=True)
        return
    exports = [f"export CHECKPOINTQ_BROKER_URL={url}"]
    if store_url:
        exports.append(f"export CHECKPOINTQ_STORE_URL={store_url}")
    hidden = " (with the passwords shown as ***)" if "***" in " ".join(exports) else ""
    lines = [
        "",
        "checkpointq is ready: a worker consumes queue "
        f"{settings.queue!r} and beat sweeps every {settings.sweep_interval_seconds:g} s",
        f"  data dir      {data}",
        f"  broker        {url}",
        f"  store         {store_url or 'the broker Redis itself (no CHECKPOINTQ_STORE_URL)'}",
        f"  other shells  need{hidden}:",
        *(f"                  {line}" for line in exports),
        *(
            [
                "                (from this directory the embedded broker is found by itself; a",
                "                store URL only from the environment or .env)",
            ]
            if embedded
            else []
        ),
        "  Python        CheckpointClient.from_settings(Settings()) with those variables",
        "  other langs   LPUSH a protocol 2 message to the broker: docs/protocol.md, clients/go",
        "  Ctrl-C to stop",
        "",
    ]
    click.echo("\n".join(lines), err=True)


@cli.command(short_help="Run one Celery worker on the queue.")
@run_options
@run_json_option
def worker(as_json: bool, **run: Any) -> None:
    """One Celery worker consuming the queue (what `up` runs, without beat or Redis).

    Run as many as the load needs, on any hosts that reach the broker; give each a node
    name of its own (-n) when several share a host.
    """
    from checkpointq.worker.app import (
        create_app,  # Celery is imported only by the commands that run it
    )

    settings = _run_settings(run, as_json)
    app = create_app(settings)
    argv = [
        "worker",
        "--queues", settings.queue,
        "--loglevel", settings.log_level,
        "--pool", settings.pool,
        "--concurrency", str(settings.concurrency),
    ]  # fmt: skip
    if settings.hostname:
        argv += ["--hostname", settings.hostname]
    if not settings.remote_control:
        # Mingle and gossip talk over the same broadcast channel as remote control; without
        # it they only cost a second at start-up and a message per worker event.
        argv += ["--without-mingle", "--without-gossip"]
    _run_celery_worker(app, argv)


def _run_celery_worker(app: Any, argv: list[str]) -> None:
    """Run ``celery worker`` with ``argv`` through Celery's own ``worker`` command.

    ``app.worker_main`` would load Celery's whole CLI first (``celery.bin.celery``: every
    subcommand, click-repl, prompt_toolkit, pygments), about 6 MB of the worker's main
    process for commands it never runs. The ``worker`` command alone parses the same options
    and starts the same worker.
    """
    from celery.bin.base import CLIContext
    from celery.bin.worker import worker as celery_worker

    obj = CLIContext(app=app, no_color=False, workdir=None, quiet=False)
    celery_worker.main(args=argv[1:], prog_name="celery worker", obj=obj, standalone_mode=False)


@cli.command(short_help="Run beat: it schedules the sweep of expired sessions.")
@click.option(
    "-l",
    "--loglevel",
    "log_level",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    help="Least severe log level shown. [CHECKPOINTQ_LOG_LEVEL; default INFO]",
)
@run_json_option
def beat(log_level: str | None, as_json: bool) -> None:
    """Celery beat: enqueues the sweep of expired sessions every
    CHECKPOINTQ_SWEEP_INTERVAL_SECONDS. Run one (a second one waits on its lock)."""
    from checkpointq.worker.app import (
        create_app,  # Celery is imported only by the commands that run it
    )

    settings = _run_settings({"log_level": log_level}, as_json)
    app = create_app(settings)
    app.start(["beat", "--loglevel", settings.log_level])


# -- enqueueing -----------------------------------------------------------------------------


def _client(settings: Settings) -> CheckpointClient:
    return CheckpointClient.from_settings(settings)


def _await(client: CheckpointClient, handle: Handle, timeout: float) -> RequestOutcome:
    """The request's outcome; a refusal (RequestRefused: kind, reason, dead-letter entry)
    propagates at once as the one-line failure."""
    try:
        return client.wait_durable(handle, timeout=timeout)
    except TimeoutError as exc:
        raise CliFailure(
            f"{exc}: is a worker running? (the request stays queued and may still apply)"
        ) from None


def _handle_json(handle: Handle, outcome: RequestOutcome | None) -> dict[str, Any]:
    return {
        "task": handle.task,
        "task_id": handle.task_id,
        "session_id": handle.session_id,
        "seq": handle.seq,
        "durable": outcome is not None,
        "outcome": outcome.outcome if outcome is not None else "enqueued",
    }


def _outcome_line(verb: str, handle: Handle, outcome: RequestOutcome | None) -> str:
    what = f"{verb} of session {handle.session_id!r}"
    if outcome is None:
        return f"enqueued {what} (task {handle.task_id}); --wait waits for a worker to apply it"
    if outcome.outcome == SUPERSEDED:
        newer = "delete" if outcome.deleted else "save"
        return (
            f"{what} superseded: a newer {newer} of the session, made {_ago_us(outcome.seq)}, "
            f"was applied first, so this one never will be (task {handle.task_id})"
        )
    return f"{what} applied (task {handle.task_id})"


def _ago_us(seq: int) -> str:
    """A request's time (its seq, µs since the epoch) for people."""
    return _when(seq / 1_000_000)


@cli.command(short_help="Enqueue a save of a checkpoint JSON file (--wait: until applied).")
@click.argument("source", type=click.File("rb"), metavar="FILE|-")
@wait_options
@json_option
def save(source: IO[bytes], wait: bool, timeout: float, as_json: bool) -> None:
    """Enqueue a save of the checkpoint JSON in FILE (or - for stdin).

    The file is validated here, before anything is enqueued. With --wait, the line printed
    says whether the save was applied or superseded by a newer request, and, when the store
    trimmed the history, how many messages it kept and why (CHECKPOINTQ_HISTORY_CAP, or the
    stored-size budget CHECKPOINTQ_MAX_VALUE_BYTES); a request the worker refused fails at
    once with its reason and dead-letter entry.
    """
    checkpoint = checkpoint_from_wire(loads_json(source.read()))
    with _client(_settings()) as client:
        handle = client.save(checkpoint)
        outcome = _await(client, handle, timeout) if wait else None
    trimmed = outcome.trimmed if outcome is not None else None
    human = [_outcome_line("save", handle, outcome)]
    if trimmed is not None:
        why = {
            HISTORY_CAP: "CHECKPOINTQ_HISTORY_CAP",
            MAX_VALUE_BYTES: "to fit the stored-size budget, CHECKPOINTQ_MAX_VALUE_BYTES",
        }[trimmed.cause]
        human.append(
            f"history trimmed: the store kept the newest {trimmed.kept} of "
            f"{trimmed.sent} messages ({why})"
        )
    messages = None if trimmed is None else dataclasses.asdict(trimmed)
    _emit(as_json, {**_handle_json(handle, outcome), "messages": messages}, human)


@cli.command(short_help="Enqueue a delete of a session (--wait: until applied).")
@click.argument("session_id")
@wait_options
@json_option
def delete(session_id: str, wait: bool, timeout: float, as_json: bool) -> None:
    """Enqueue a delete of a session (a tombstone keeps late saves from resurrecting it)."""
    with _client(_settings()) as client:
        handle = client.delete(session_id)
        outcome = _await(client, handle, timeout) if wait else None
    _emit(as_json, _handle_json(handle, outcome), [_outcome_line("delete", handle, outcome)])


# -- reading sessions -----------------------------------------------------------------------


def _show_lines(checkpoint: Checkpoint, settings: Settings) -> Iterator[str]:
    meta = checkpoint.metadata
    yield f"session   {display_id(checkpoint.session_id)}"
    yield f"version   {checkpoint.version}"
    yield f"messages  {_history_words(checkpoint, settings)}"
    if meta.total_tokens:
        yield f"tokens    {meta.total_tokens}"
    if meta.total_cost_usd:
        yield f"cost      ${meta.total_cost_usd}"
    if meta.last_message_time is not None:
        yield f"last      {_when(meta.last_message_time.timestamp())}"
    if checkpoint.last_run_ref:
        yield f"last run  {checkpoint.last_run_ref}"
    for message in checkpoint.conversation_history[-5:]:
        content = " ".join(message.content.split())
        yield f"  {message.role}: {content[:120]}{'…' if len(content) > 120 else ''}"


def _history_words(checkpoint: Checkpoint, settings: Settings) -> str:
    """How many messages are stored and, when the conversation had more, what may have
    dropped them: the cap only when it is full, as a budget trim keeps fewer."""
    kept = len(checkpoint.conversation_history)
    total = checkpoint.metadata.total_messages
    words = f"{kept} stored"
    if total <= kept and kept >= settings.history_cap:
        words += f" (CHECKPOINTQ_HISTORY_CAP: at most {settings.history_cap}, the newest)"
    elif total > kept:
        words += f" (the newest), of {total} in the conversation (metadata.totalMessages)"
        if kept >= settings.history_cap:
            words += f": CHECKPOINTQ_HISTORY_CAP is {settings.history_cap}"
        else:
            # Under the cap: the rest was not sent, or the store dropped it to fit the budget.
            words += (
                f": fewer than CHECKPOINTQ_HISTORY_CAP ({settings.history_cap}), so the rest "
                "was not sent or did not fit the stored-size budget, CHECKPOINTQ_MAX_VALUE_BYTES "
                f"({settings.max_value_bytes} bytes compressed)"
            )
    return words


def _request_words(request: Fence) -> str:
    """A request for people: its seq, and when it was made."""
    return f"seq {request.seq}, made {_ago_us(request.seq)}"


@cli.command(short_help="Print a session's checkpoint, as producers load it.")
@click.argument("session_id")
@json_option
def show(session_id: str, as_json: bool) -> None:
    """Print a session's checkpoint as every producer's load answers: the store's, or a
    save still queued (said on a `pending` line; with --json, on stderr, so that the
    document stays the checkpoint alone)."""
    from checkpointq.worker.ops import sessions

    settings = _settings()
    with _client(settings) as client:
        session = sessions.read(client, session_id)
    checkpoint, queued = session.checkpoint, session.queued
    if checkpoint is None:
        if queued is not None:
            raise CliFailure(
                f"no live session {session_id!r}: deleted by a request still queued "
                f"({_request_words(queued)}), not yet applied in the store"
            )
        raise CliFailure(f"no live session {session_id!r}")
    # The document is the checkpoint's alone, so it can be saved back as it is (fields of
    # ours would be kept in it as unknown ones); a queued answer is said beside it.
    document = checkpoint_to_wire(checkpoint)
    human = list(_show_lines(checkpoint, settings))
    if queued is not None:
        note = f"a save ({_request_words(queued)}) is queued and not yet in the store"
        human.insert(1, f"pending   {note}")
        if as_json:
            click.echo(f"# pending: {note}", err=True)
    _emit(as_json, document, human)


@cli.command(name="ls", short_help="List live session ids (all, or a page at a time).")
@click.option(
    "--limit", type=click.IntRange(min=1), metavar="N", help="Print at most N ids, then stop."
)
@click.option(
    "--cursor",
    metavar="CURSOR",
    help="Print the page starting at this cursor (the previous page printed it on stderr).",
)
@click.option(
    "--page-size",
    type=click.IntRange(min=1),
    metavar="N",
    help="Print one page of about N ids, and on stderr the command for the next page. "
    "Pages walk the store alone: writes still queued are not merged in.",
)
@json_option
def list_sessions(
    limit: int | None, cursor: str | None, page_size: int | None, as_json: bool
) -> None:
    """List live session ids as every producer's list answers, writes still queued included
    (all of them, sorted; or one page of the store with --page-size/--cursor)."""
    settings = _settings()
    if page_size is not None or cursor is not None:
        _list_store_page(settings, cursor, page_size, as_json)
        return
    from checkpointq.worker.ops import sessions

    with _client(settings) as client:
        listing = sessions.listing(client, limit)
    if not as_json:
        if listing.queued_saves:
            _hint(
                f"pending: {_some_ids(listing.queued_saves)}: listed for a save still queued, "
                "not yet in the store"
            )
        if listing.queued_deletes:
            _hint(
                f"pending: {_some_ids(listing.queued_deletes)}: not listed: a delete is "
                "queued, not yet applied in the store"
            )
    data = {
        "sessions": listing.sessions,
        "cursor": None,
        "pending_saves": listing.queued_saves,
        "pending_deletes": listing.queued_deletes,
    }
    _emit(as_json, data, [display_id(session_id) for session_id in listing.sessions])


def _some_ids(ids: list[str], shown: int = 5) -> str:
    """A few ids for a hint line, escaped, and how many more."""
    names = ", ".join(display_id(session_id) for session_id in ids[:shown])
    return names + (f" and {len(ids) - shown} more" if len(ids) > shown else "")


def _list_store_page(
    settings: Settings, cursor: str | None, page_size: int | None, as_json: bool
) -> None:
    """One page of the store's live ids (``ls --page-size/--cursor``): a cursor walks the
    store's index, which the queued writes are not part of."""
    store = connections.open_store(settings)
    try:
        page = store.list_page(cursor, page_size or 1000)
    finally:
        store.close()
    if page.cursor is not None and not as_json:
        size = f" --page-size {page_size}" if page_size is not None else ""
        _hint(f"more: checkpointq ls{size} --cursor {page.cursor}")
    data = {
        "sessions": page.session_ids,
        "cursor": page.cursor,
        "pending_saves": None,
        "pending_deletes": None,
    }
    # Ids are any text Go accepted (tabs, line separators, bidi controls): shown escaped.
    _emit(as_json, data, [display_id(session_id) for session_id in page.session_ids])


@cli.command(short_help="Print queue depth, sessions, dead letters, workers, throughput.")
@json_option
def stats(as_json: bool) -> None:
    """Queue depth, sessions, dead letters, workers and their totals (what `top` shows)."""
    from checkpointq.worker.ops import (
        top as top_view,  # rich is imported only by the commands that use it
    )

    snapshot = top_view.collect(_settings())
    _emit(as_json, snapshot.as_json(), top_view.stats_lines(snapshot))


@cli.command(short_help="Live view of throughput, queue, lag and workers (q quits).")
@click.option(
    "--interval",
    type=click.FloatRange(min=0.1),
    default=1.0,
    show_default=True,
    metavar="SECONDS",
    help="Seconds between two refreshes of the screen.",
)
@click.option(
    "--once",
    is_flag=True,
    help="Draw one screen and exit: 0 if the broker and store could be read, else 1.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one JSON snapshot (what `stats --json` prints) per interval instead of the "
    "screen; with --once, one.",
)
def top(interval: float, once: bool, as_json: bool) -> None:
    """A live view: throughput by outcome, queue depth, lag, dead letters, next sweep,
    workers. Fits 80x24; q (or Ctrl-C) quits."""
    from checkpointq.worker.ops import (
        top as top_view,  # rich is imported only by the commands that use it
    )

    settings = _settings()
    if as_json:
        try:
            while True:
                click.echo(json.dumps(top_view.collect(settings).as_json()))
                if once:
                    return
                time.sleep(interval)
        except KeyboardInterrupt:
            return
    if not top_view.run(settings, interval=interval, once=once):
        raise SystemExit(EXIT_FAILURE)


@cli.command(short_help="Exit 0 if broker, store and a worker (or beat) are alive.")
@click.option(
    "--local",
    is_flag=True,
    help="Require a worker on this host: the probe inside a worker's container or pod.",
)
@click.option(
    "--beat",
    is_flag=True,
    help="Check beat instead of workers: healthy unless the next sweep is over 30 s late "
    "(beat's own probe).",
)
@json_option
def health(local: bool, beat: bool, as_json: bool) -> None:
    """Exit 0 when the broker answers, the store accepts a write, and a worker is alive and
    making progress (or beat's schedule is on time, with --beat).

    Workers are seen through their heartbeats in the store Redis, not remote control. A
    Redis whose maxmemory-policy may evict keys is a warning, which leaves the exit code;
    so is a broker that lost accepted requests (producers found it went back in time).
    """
    from checkpointq.worker.ops import health as checks

    report = checks.check(_settings(), local=local, beat=beat)
    if as_json:
        click.echo(json.dumps(report.as_json()))
    else:
        # On stdout, after the status when healthy: a failure stays one line on stderr.
        for line in ([report.line()] if report.ok else []) + report.warning_lines():
            click.echo(line)
    if not report.ok:
        if not as_json:
            click.echo(f"checkpointq: {report.line()}", err=True)
        raise SystemExit(EXIT_FAILURE)


# -- encryption -----------------------------------------------------------------------------


@cli.command(short_help="Print a fresh encryption key pair (id:key) for ENCRYPTION_KEYS.")
@click.option(
    "--id",
    "key_id",
    default=None,
    metavar="ID",
    help="The key's id (1-32 letters, digits, '_', '-', '.'); default k<UTC date and time>.",
)
@json_option
def keygen(key_id: str | None, as_json: bool) -> None:
    """Print a new key pair, ``id:key``: 32 random bytes in URL-safe base64.

    Put it first in CHECKPOINTQ_ENCRYPTION_KEYS to encrypt new writes with it (the keys after
    it still decrypt); docs/security.md describes rotation. Nothing is stored or sent."""
    key_id = key_id or datetime.now(UTC).strftime("k%Y%m%d%H%M%S")
    if not encryption.KEY_ID.fullmatch(key_id):
        raise click.BadParameter("1-32 letters, digits, '_', '-' or '.'", param_hint="--id")
    key = encryption.generate_key()
    _emit(as_json, {"key_id": key_id, "key": key, "pair": f"{key_id}:{key}"}, [f"{key_id}:{key}"])


@cli.command(short_help="Rewrite every stored value under the first encryption key.")
@click.option("--cursor", help="Resume after this point (printed on stderr as it goes).")
@click.option(
    "--page-size",
    type=click.IntRange(min=1, max=10_000),
    default=500,
    show_default=True,
    help="Sessions read and rewritten per step.",
)
@json_option
def rekey(cursor: str | None, page_size: int, as_json: bool) -> None:
    """Rewrite every live session's value sealed under the first key of
    CHECKPOINTQ_ENCRYPTION_KEYS (clear values and values of older keys included), so that an
    older key can then be removed. Each rewrite is fenced: a save applied meanwhile wins."""
    settings = _settings()
    if settings.keyring is None:
        raise CliFailure(
            "no encryption keys: set CHECKPOINTQ_ENCRYPTION_KEYS (the first key is the one "
            "values are rewritten under)"
        )
    store = connections.open_store(settings)
    rewritten = superseded = 0
    failed: list[tuple[str, str]] = []
    try:
        for page in rekey_store(store, cursor, page_size):
            rewritten += page.rewritten
            superseded += page.superseded
            failed += page.failed
            if page.cursor is not None and not as_json:
                _hint(
                    f"rekeyed {rewritten}, superseded {superseded}, failed {len(failed)} so "
                    f"far; resume with: checkpointq rekey --cursor {page.cursor}"
                )
    finally:
        store.close()
    key_id = settings.keyring.primary
    human = [f"rewrote {rewritten} session(s) under key {key_id!r}"]
    if superseded:
        human.append(f"{superseded} written or deleted meanwhile by newer requests (left as is)")
    human += [f"failed {display_id(sid)}: {why}" for sid, why in failed]
    data = {
        "key_id": key_id,
        "rewritten": rewritten,
        "superseded": superseded,
        "failed": [{"session_id": sid, "reason": why} for sid, why in failed],
    }
    _emit(as_json, data, human)
    if failed:
        raise CliFailure(f"{len(failed)} session(s) could not be read; see above")


# -- housekeeping ---------------------------------------------------------------------------


@cli.command(short_help="Expire stale sessions now (what beat does every interval).")
@json_option
def sweep(as_json: bool) -> None:
    """Expire stale sessions now (what beat does every sweep interval)."""
    settings = _settings()
    keys = connections.key_space(settings)
    store = connections.open_store(settings)
    client = connections.store_client(settings)
    expired = 0
    locked_out = False
    try:
        due = store.count_sessions().expired
        with click.progressbar(
            length=due, label="sweeping", file=sys.stderr, hidden=as_json or due < SWEEP_BATCH
        ) as bar:
            while True:
                result = run_sweep(
                    store, client, keys, limit=SWEEP_BATCH, events_maxlen=settings.events_maxlen
                )
                expired += len(result.expired)
                bar.update(len(result.expired))
                if result.locked_out:
                    locked_out = True
                    break
                if not result.more:
                    break
    finally:
        store.close()
        client.close()
    outcome = "locked_out" if locked_out else "swept"
    human = [f"expired {expired} session(s)"]
    if locked_out:
        human.append("another sweep holds the lock; it carries on")
    _emit(as_json, {"outcome": outcome, "expired": expired}, human)


# -- dead letters ---------------------------------------------------------------------------


def _dead_letters(settings: Settings) -> DeadLetters:
    client = connections.store_client(settings)
    return DeadLetters(client, connections.key_space(settings), maxlen=settings.dead_letter_maxlen)


def _when(seconds: float) -> str:
    """A time for people: UTC to the second, and how long ago."""
    at = datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    ago = time.time() - seconds
    if ago < 0:
        return at
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if ago >= size:
            return f"{at} ({ago / size:.0f} {unit} ago)"
    return f"{at} ({ago:.0f} s ago)"


@cli.group()
def dlq() -> None:
    """Requests the worker refused: list, show, replay, purge."""


@dlq.command(name="ls")
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=50,
    show_default=True,
    metavar="N",
    help="Entries per page; when more remain, the next page's command is printed on stderr.",
)
@click.option("--cursor", help="Continue after this entry id (printed by the previous page).")
@json_option
def dlq_list(limit: int, cursor: str | None, as_json: bool) -> None:
    """List dead letters, oldest first."""
    letters = _dead_letters(_settings())
    try:
        page = letters.list(count=limit, cursor=cursor)
    finally:
        letters.client.close()
    human = [
        f"{e.id}  {_when(e.time)}  {e.kind:<17} {e.task or '-'}  {' '.join(e.reason.split())[:80]}"
        for e in page.entries
    ]
    if not page.entries:
        human = ["no dead letters" if cursor is None else f"no dead letters after {cursor}"]
    if page.cursor is not None and not as_json:
        _hint(f"more: checkpointq dlq ls --limit {limit} --cursor {page.cursor}")
    data = {"entries": [e.as_json() for e in page.entries], "cursor": page.cursor}
    _emit(as_json, data, human)


@dlq.command(name="show")
@click.argument("entry_id")
@json_option
def dlq_show(entry_id: str, as_json: bool) -> None:
    """Print one dead letter with its raw payload."""
    settings = _settings()
    letters = _dead_letters(settings)
    try:
        letter = letters.get(entry_id)
    finally:
        letters.client.close()
    if letter is None:
        raise CliFailure(f"no dead letter {entry_id!r}")
    data, lines = letter.as_json(), list(_letter_lines(letter))
    sealed = letter.sealed_value
    if sealed is not None and letter.args:
        # Encrypted: the entry holds ciphertext; it is opened here only with the keys.
        opened = _open_sealed(settings, str(letter.args[0]), sealed)
        data["checkpoint"] = opened if isinstance(opened, dict) else None
        lines.append(
            f"checkpoint {_compact(opened)[:2000] if isinstance(opened, dict) else opened}"
        )
    _emit(as_json, data, lines)


def _open_sealed(settings: Settings, session_id: str, sealed: bytes) -> dict[str, Any] | str:
    """A dead letter's sealed value as the checkpoint's JSON, or why it cannot be shown."""
    key_id = encryption.sealed_key_id(sealed) or "?"
    if settings.keyring is None:
        return f"(encrypted under key id {key_id!r}: set CHECKPOINTQ_ENCRYPTION_KEYS to show it)"
    try:
        checkpoint = InMemoryStore(settings.store_options()).decode_value(session_id, sealed)
    except CheckpointError as exc:
        return f"(cannot be opened: {exc})"
    return checkpoint_to_wire(checkpoint)


def _letter_lines(letter: DeadLetter) -> Iterator[str]:
    """A dead letter for people: times readable, JSON as JSON, nothing absent shown."""
    yield f"id         {letter.id}"
    yield f"refused    {_when(letter.time)} ({letter.kind}, after {letter.retries} retries)"
    yield f"reason     {' '.join(letter.reason.split())}"
    yield f"task       {letter.task or '(no task name could be read)'} [{letter.task_id or '-'}]"
    if letter.args is not None:
        yield f"args       {_compact(letter.args)[:500]}"
    if letter.kwargs:
        yield f"kwargs     {_compact(letter.kwargs)}"
    if letter.headers:
        yield f"headers    {_compact(letter.headers)[:500]}"
    kept = letter.kind == Reason.OVERSIZE and letter.headers.get("raw_key")
    how = (
        f"yes: checkpointq dlq replay {letter.id}"
        if letter.replayable
        else f"as it arrived, while the broker keeps it: checkpointq dlq replay {letter.id}"
        if kept
        else f"no: {letter.never_applies}"
    )
    yield f"replayable {how}"
    raw = letter.raw.decode("utf-8", errors="replace")
    shown = raw[:2000] + (f"… ({letter.raw_bytes} bytes in all)" if len(raw) > 2000 else "")
    yield f"raw        {shown}"


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


@dlq.command(name="replay")
@click.argument("entry_ids", nargs=-1)
@click.option(
    "--all",
    "replay_all",
    is_flag=True,
    help="Replay every replayable entry (those that could never apply, as `dlq show` says, "
    "are left).",
)
@json_option
def dlq_replay(entry_ids: tuple[str, ...], replay_all: bool, as_json: bool) -> None:
    """Enqueue dead letters again (by id, or --all), removing each once it is enqueued."""
    if bool(entry_ids) == replay_all:
        raise click.UsageError("give entry ids or --all (not both)")
    settings = _settings()
    letters = _dead_letters(settings)
    sender = _client(settings)
    replayed: list[dict[str, str]] = []
    skipped: list[dict[str, str]] = []
    try:
        ids = list(entry_ids) if entry_ids else list(_all_dead_letter_ids(letters))
        with click.progressbar(
            ids, label="replaying", file=sys.stderr, hidden=as_json or len(ids) < 100
        ) as bar:
            for entry_id in bar:
                outcome = _replay_one(letters, sender, entry_id, strict=not replay_all)
                (replayed if "task_id" in outcome else skipped).append(outcome)
    finally:
        letters.client.close()
        sender.close()
    human = [f"replayed {len(replayed)} dead letter(s)"]
    human += [f"skipped {s['id']}: {s['reason']}" for s in skipped]
    _emit(as_json, {"replayed": replayed, "skipped": skipped}, human)


def _all_dead_letter_ids(letters: DeadLetters) -> Iterator[str]:
    cursor: str | None = None
    while True:
        page = letters.list(count=DLQ_PAGE, cursor=cursor)
        for entry in page.entries:
            if entry.replayable:
                yield entry.id
        if page.cursor is None:
            return
        cursor = page.cursor


def _replay_one(
    letters: DeadLetters, sender: Any, entry_id: str, *, strict: bool
) -> dict[str, str]:
    try:
        if strict and (requeued := _requeue_oversize(letters, entry_id)) is not None:
            return requeued
        return {"id": entry_id, "task_id": letters.replay(entry_id, sender)}
    except (NotFound, NotReplayable) as exc:
        if strict:
            raise
        return {"id": entry_id, "reason": str(exc)}


def _requeue_oversize(letters: DeadLetters, entry_id: str) -> dict[str, str] | None:
    """Put an oversize item the broker still keeps back in its queue, as it arrived (by id
    only: a worker with the same limit refuses it again); None: not such an entry."""
    letter = letters.get(entry_id)
    if letter is None or letter.kind != Reason.OVERSIZE:
        return None
    raw_key, raw_list = letter.headers.get("raw_key"), letter.headers.get("raw_list")
    if not raw_key or not raw_list:
        return None
    settings = _settings()
    url = settings.broker_url
    if not url or not is_redis_url(url):
        raise CliFailure("oversize items are kept on a Redis broker only")
    from checkpointq.worker import oversize  # the worker's modules: only when needed

    # The item moves inside the broker (a copy of up to 512 MB): more than a CLI's timeout.
    broker = redis.Redis.from_url(redis_py_url(url), socket_timeout=120)
    try:
        if not oversize.requeue(broker, KeySpace(settings.key_prefix), raw_key, raw_list):
            raise NotReplayable(f"dead letter {entry_id}: its raw item is no longer kept")
    finally:
        broker.close()
    letters.remove(entry_id)
    return {"id": entry_id, "task_id": letter.task_id or "", "requeued": raw_key}


@dlq.command(name="purge")
@click.confirmation_option(prompt="Remove every dead letter?")
@json_option
def dlq_purge(as_json: bool) -> None:
    """Remove every dead letter."""
    letters = _dead_letters(_settings())
    try:
        removed = letters.purge()
    finally:
        letters.client.close()
    _emit(as_json, {"removed": removed}, [f"removed {removed} dead letter(s)"])


# -- the database ----------------------------------------------------------------------------


@cli.group()
def db() -> None:
    """A PostgreSQL store's schema: see its version, upgrade it."""


def _database(settings: Settings) -> Any:
    """A connection to the PostgreSQL store (autocommit), or a clear error."""
    if not settings.store_is_postgres:
        raise CliFailure(
            "the store is not PostgreSQL: set CHECKPOINTQ_STORE_URL=postgresql://... "
            "(a Redis store has no schema to upgrade)"
        )
    try:
        import psycopg
    except ImportError:
        raise MissingExtra(
            "a PostgreSQL store needs psycopg: pip install 'checkpointq[postgres]'"
        ) from None
    url = settings.resolved_store_url or ""
    try:
        return psycopg.connect(url, autocommit=True, connect_timeout=5)
    except psycopg.Error as exc:
        raise CliFailure(f"{redact_url(url)}: {redact_urls(str(exc).strip())}") from None


@db.command(name="upgrade", short_help="Create or upgrade the store's schema (idempotent).")
@json_option
def db_upgrade(as_json: bool) -> None:
    """Create the PostgreSQL store's schema, or bring it to this version; safe to run again
    and from several places at once (one upgrades, under a lock; the others find it done)."""
    from checkpointq.store import postgres_schema

    settings = _settings(resolve=False)
    with _database(settings) as conn:
        try:
            applied = postgres_schema.upgrade(conn, settings.pg_schema)
        except postgres_schema.SchemaMismatch as exc:
            raise CliFailure(str(exc)) from None
    version = postgres_schema.SCHEMA_VERSION
    human = (
        [f"schema {settings.pg_schema}: upgraded to version {version} (applied {applied})"]
        if applied
        else [f"schema {settings.pg_schema}: already at version {version}"]
    )
    _emit(as_json, {"schema": settings.pg_schema, "version": version, "applied": applied}, human)


@db.command(name="version", short_help="Print the schema version in the database.")
@json_option
def db_version(as_json: bool) -> None:
    """The PostgreSQL store's schema version, and the one this checkpointq speaks."""
    from checkpointq.store import postgres_schema

    settings = _settings(resolve=False)
    with _database(settings) as conn:
        found = postgres_schema.current_version(conn, settings.pg_schema)
    speaks = postgres_schema.SCHEMA_VERSION
    state = "current" if found == speaks else ("missing" if found == 0 else "differs")
    _emit(
        as_json,
        {"schema": settings.pg_schema, "version": found, "expected": speaks, "state": state},
        [f"schema {settings.pg_schema}: version {found or 'none'} (this checkpointq: {speaks})"],
    )


def main() -> None:
    """The console script's entry point."""
    try:
        try:
            cli(prog_name="checkpointq")
        finally:
            sys.stdout.flush()  # here, not at interpreter exit, so a closed pipe is caught
    except BrokenPipeError:
        quiet_stdout()
        sys.exit(0)


if __name__ == "__main__":  # `python -m checkpointq.worker.cli`, how `up` starts its children
    main()
