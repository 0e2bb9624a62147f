"""Remote command lines: argument lists quoted once, run under a host-side timeout, in a
controlled environment.

Every command the orchestrator sends to a host is built here, as a string for the host's
POSIX shell. Values (paths, environment, arguments) are quoted with shlex.quote exactly once;
the engine's trusted snippets are passed as one quoted argument to `bash -c`, never spliced.

    cd -- DIR && umask 077 && exec env -i HOME="$HOME" ... PATH=CUDA/bin:"$PATH" KEY=VALUE ... \
        bash -c GUARD kdtree-step KILL_AFTER TIMEOUT ARGV...

GUARD starts `setsid -w timeout -k KILL_AFTER TIMEOUT ARGV...`: a new session (own process
group) that coreutils `timeout` signals as a whole (TERM, then KILL after KILL_AFTER seconds),
so nothing the step started outlives its timeout (exit status 124, or 137 after KILL); processes
that left the group (setsid, daemons) are found by a tag in their environment and killed. GUARD
also stops that process group when the command's stdin reaches its end: the client keeps stdin
open while it waits, so closing the channel, a dead client or a lost connection stops the step
on the host too (closing an ssh channel alone does not); and when the step ends, whatever it
left running in its group is killed. A command that reads data from stdin (`reads_stdin=True`)
runs without GUARD, under the timeout only.
"""
from __future__ import annotations

import dataclasses
import os
import shlex
from typing import BinaryIO, Iterable, Mapping, Sequence

from . import ownership
from .errors import UsageError
from .host import script_text
from .inventory import Host

KILL_AFTER = 10          # seconds between TERM and KILL when a timeout fires
# Every command's umask: nothing the orchestrator or the engine writes on a host is readable by
# another user of it (a secret in a result file, a binary they could run on our GPU).
UMASK = "077"
CLIENT_GRACE = 15        # the client waits this long past TIMEOUT + KILL_AFTER before giving up
TIMEOUT_EXIT_CODES = (124, 137)     # coreutils timeout's, when the host-side timeout fired
# What a step keeps of the host's own session environment. LD_LIBRARY_PATH stays: GPU hosts
# commonly reach the driver's and CUDA's libraries through it (the host's setting, not ours).
INHERITED_ENV = ('HOME="$HOME"', 'USER="$USER"', 'LOGNAME="$LOGNAME"', 'LANG="${LANG:-C.UTF-8}"',
                 'LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}"')


@dataclasses.dataclass(frozen=True)
class Command:
    """One command for a host, as data: the argv it runs, its full command line (wrap's), the
    host-side timeout it runs under (None: none), the data it reads first on stdin, the secret
    values it receives (redacted from whatever shows its output), and what it does (for
    messages). The transport derives the client's deadline from the timeout (`deadline`), so a
    limit is never given twice."""

    argv: tuple[str, ...]
    line: str
    timeout: float | None
    stdin: bytes | BinaryIO | None = None      # data, or a stream read to its end
    holds_stdin: bool = False   # after `stdin`, stdin stays open until the command ends (GUARD)
    secrets: tuple[str, ...] = ()
    what: str = "command"

    @property
    def deadline(self) -> float | None:
        """Seconds the client waits before it gives up: the host-side timeout, the host's
        TERM-to-KILL grace and a margin (None: no limit)."""
        return None if self.timeout is None else client_timeout(self.timeout)


def timed_out(code: int | None) -> bool:
    """Whether a command that ended with exit status `code` (None: no answer before the client's
    deadline) ran past its timeout."""
    return code is None or code in TIMEOUT_EXIT_CODES


def command(argv: Sequence[str], *, timeout: float | None, cwd: str | None = None,
            stdin: bytes | BinaryIO | None = None, what: str = "command") -> Command:
    """`argv` as a Command (wrap's command line); with `stdin` data it reads its stdin, unguarded."""
    line = wrap(argv, timeout=timeout, cwd=cwd, reads_stdin=stdin is not None)
    return Command(tuple(argv), line, timeout, stdin, what=what)


def step(host: Host, snippet: str, timeout: float, *, with_secrets: bool = False,
         env: Mapping[str, str] | None = None, what: str = "command") -> Command:
    """An engine command (a trusted snippet of hosts.yaml) as a Command run in the host's
    remote_dir (step_command); `with_secrets`: it gets the host's secret_env on stdin."""
    secrets = with_secrets and bool(host.secret_env)
    line = step_command(host, snippet, timeout, with_secrets=secrets, env=env)
    return _with_secrets(host, ("bash", "-c", snippet), line, timeout, secrets, what)


def adhoc(host: Host, argv: Sequence[str], timeout: float, env: Mapping[str, str] | None = None) -> Command:
    """The user's own command (`invoke exec -- ARGV`) as a Command: each word of `argv` quoted
    once, run in the login directory (no remote_dir needed) with the steps' environment and the
    host's secret_env (on stdin), under the steps' timeout and process-group guard."""
    line = wrap(argv, timeout=timeout, env={**host_env(host), **(env or {})}, path_prefix=host_path_prefix(host),
                secrets=host.secret_env)
    return _with_secrets(host, tuple(argv), line, timeout, bool(host.secret_env), "command")


def _with_secrets(host: Host, argv: tuple[str, ...], line: str, timeout: float, secrets: bool, what: str) -> Command:
    """A Command whose line reads the host's secret values first on stdin when `secrets`."""
    return Command(argv, line, timeout, secret_input(host) if secrets else None, secrets,
                   tuple(secret_strings(host)) if secrets else (), what)


def quote(argv: Sequence[str]) -> str:
    """An argument list as one shell command line (each argument quoted once)."""
    return shlex.join(str(a) for a in argv)


def host_env(host: Host) -> dict[str, str]:
    """The step environment of a host: CUDA_HOME, PYTHON, KD_BACKEND, KD_ARCH (unless auto)."""
    env = {}
    if host.cuda_home:
        env["CUDA_HOME"] = host.cuda_home
    env["PYTHON"] = host.python
    env["KD_BACKEND"] = host.backend
    if host.arch != "auto":
        env["KD_ARCH"] = host.arch
    return env


def host_path_prefix(host: Host) -> tuple[str, ...]:
    """Directories put first on PATH for a host's steps ($CUDA_HOME/bin)."""
    return (f"{host.cuda_home}/bin",) if host.cuda_home else ()


def wrap(argv: Sequence[str], *, timeout: float | None, cwd: str | None = None,
         env: Mapping[str, str] | None = None, path_prefix: Sequence[str] = (),
         kill_after: float = KILL_AFTER, reads_stdin: bool = False, secrets: Sequence[str] = ()) -> str:
    """`argv` as a command line run (umask UMASK) in `cwd` with only the inherited basics plus `env`,
    `path_prefix` first on PATH, in its own session, killed (whole group) after `timeout` or
    when its stdin closes (unless it `reads_stdin`); timeout None: none of this, just `argv`.
    `secrets`: names of variables whose values come first on stdin (secret_input), never on
    the command line."""
    for key in [*(env or {}), *secrets]:
        if not key.isidentifier():
            raise ValueError(f"not an environment variable name: {key!r}")
    path = 'PATH=' + (shlex.quote(":".join(path_prefix) + ":") if path_prefix else "") + '"$PATH"'
    parts = [f"umask {UMASK} &&", "exec env -i", *INHERITED_ENV, path]
    parts += [shlex.quote(f"{k}={v}") for k, v in (env or {}).items()]
    if secrets:
        parts += ["bash -c", shlex.quote(SECRETS), "kdtree-secrets", shlex.quote(",".join(secrets))]
    if timeout is not None and reads_stdin:
        parts += ["setsid -w timeout -k", _seconds(kill_after), _seconds(timeout)]
    elif timeout is not None:
        parts += ["bash -c", shlex.quote(GUARD), "kdtree-step", _seconds(kill_after), _seconds(timeout)]
    parts.append(quote(argv))
    line = " ".join(parts)
    return f"cd -- {shlex.quote(cwd)} && {line}" if cwd else line


def step_command(host: Host, snippet: str, timeout: float, with_secrets: bool = False,
                 env: Mapping[str, str] | None = None) -> str:
    """An engine command (a trusted snippet of hosts.yaml) as run in the host's remote_dir, once
    remote_dir passes the ownership check (ownership.guarded), `env` added to the host's step
    environment; `with_secrets`: it also gets the host's secret_env (send secret_input(host) as its stdin)."""
    line = wrap(["bash", "-c", snippet], timeout=timeout, cwd=host.remote_dir,
                env={**host_env(host), **(env or {})}, path_prefix=host_path_prefix(host),
                secrets=host.secret_env if with_secrets else ())
    return ownership.guarded(host.remote_dir, line)     # nothing runs from a tree another user could change


def secret_values(host: Host) -> dict[str, str]:
    """The values of the host's secret_env, from this process's environment; UsageError names the
    host and the variable when one is not set."""
    missing = [name for name in host.secret_env if name not in os.environ]
    if missing:
        raise UsageError(f"host {host.name!r}: secret_env {missing[0]} is not set in the environment")
    return {name: os.environ[name] for name in host.secret_env}


def secret_strings(host: Host) -> list[str]:
    """What to redact for a host: each secret_env value and, for a value of several lines, each
    line of at least 6 characters (output is redacted line by line)."""
    values = list(secret_values(host).values())
    return values + [line for v in values if "\n" in v for line in v.splitlines() if len(line.strip()) >= 6]


def host_secrets(hosts: Iterable[Host]) -> dict[str, tuple[str, ...]]:
    """Each host's strings to redact (secret_strings), by host name; UsageError when a secret_env
    variable is not set here."""
    return {host.name: tuple(secret_strings(host)) for host in hosts}


def secret_input(host: Host) -> bytes:
    """What a command built with `with_secrets` reads first on stdin: each value, NUL-terminated."""
    values = secret_values(host)
    if any("\0" in v for v in values.values()):
        raise UsageError(f"host {host.name!r}: a secret_env value contains a NUL byte")
    return b"".join(values[name].encode() + b"\0" for name in host.secret_env)


def client_timeout(timeout: float) -> float:
    """How long the client waits for a command wrapped with `timeout` before it gives up."""
    return timeout + KILL_AFTER + CLIENT_GRACE


def _seconds(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


SECRETS = script_text("secrets")    # host/secrets.sh
GUARD = script_text("step_guard")   # host/step_guard.sh
