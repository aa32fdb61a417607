"""Supervise the packaged llama-server: start, wait until ready, stop; never leave an orphan.

    from ikdflash import Server, complete
    with Server("target.gguf", ctx_size=4096) as url:
        print(complete(url, "Hello", max_tokens=16).text)

The process has four states: stopped -> starting -> ready -> stopped. Start polls /health
until a deadline and fails at once if the child exits early; stop sends SIGTERM to the
process group, waits a grace period, then SIGKILL.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import shutil
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Callable, Mapping, Sequence

from ikdflash import rules
from ikdflash.serving.fork import server_binary


class ServerError(RuntimeError):
    """llama-server could not be started, or died. ``reason``: llama-server's own words for why,
    when it said any (its error lines, never its usage text)."""

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason


# llama-server prints its whole usage text after a bad argument; the line before it says what
# was wrong. Lines from the first of these on are left out of the reason, and out of our stdout.
USAGE_START = (b"usage:", b"----- common params -----")
REASON_WORDS = ("error", "failed", "invalid", "unknown", "cannot", "must", "not supported")
REASON_LINES = 5


def refusal_reason(lines: Sequence[str]) -> str | None:
    """What a llama-server that exited during start-up said was wrong: its lines that report an
    error (at most REASON_LINES, the last ones), or else its last lines; the usage text never."""
    said = [line.strip() for line in lines if line.strip()]
    errors = [line for line in said if any(word in line.lower() for word in REASON_WORDS)]
    chosen = (errors or said)[-REASON_LINES:]
    return "\n".join(chosen) if chosen else None


def _write_stdout(line: bytes) -> None:
    """The server's bytes as they are where stdout takes bytes; else text, unencodable characters
    escaped (a stdout whose encoding cannot take one must not stop the forwarding)."""
    out = getattr(sys.stdout, "buffer", None)
    if out is not None:
        out.write(line)
        out.flush()
    else:
        text = line.decode("utf-8", errors="replace")
        encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
        sys.stdout.write(text.encode(encoding, errors="backslashreplace").decode(encoding))
        sys.stdout.flush()


class _Output:
    """Reads the server's output as it comes: keeps its start-up lines (for refusal_reason) and
    passes every line on to the log file, our stdout, or nowhere. The usage text a bad argument
    brings goes to the log file only."""

    KEPT = 400

    def __init__(self, pipe: IO[bytes], log: IO[bytes] | None, to_stdout: bool) -> None:
        self._lines: collections.deque[str] = collections.deque(maxlen=self.KEPT)
        self._lock = threading.Lock()
        self._pipe, self._log, self._to_stdout = pipe, log, to_stdout
        self._in_usage = False
        self._thread = threading.Thread(target=self._pump, name="llama-server-output", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        forward = self._to_stdout
        for line in iter(self._pipe.readline, b""):
            if line.lstrip().startswith(USAGE_START):
                self._in_usage = True
            try:
                if self._log is not None:
                    self._log.write(line)
                    self._log.flush()
                elif forward and not self._in_usage:
                    _write_stdout(line)
            except Exception:  # our stdout or the log went away: keep draining the pipe
                forward, self._log = False, None
            if not self._in_usage:
                with self._lock:
                    self._lines.append(line.decode("utf-8", errors="replace"))
        self._pipe.close()

    @property
    def lines(self) -> list[str]:
        """The last KEPT lines the server wrote, its usage text left out."""
        with self._lock:
            return list(self._lines)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def accepts_connections(host: str, port: int, timeout: float = 1.0) -> bool:
    """Whether something listening at host:port answers a TCP connection."""
    try:
        with socket.create_connection((host.strip("[]"), port), timeout=timeout):
            return True
    except OSError:
        return False


def port_in_use(host: str, port: int) -> bool:
    """Whether something listens at the port: a connection answers. llama-server's socket library
    binds with SO_REUSEPORT, so a second llama-server would bind a port one already listens on and
    share it (taking half its connections); only a connection tells. Nothing else is guessed: a
    trial bind beside the connection took a host that is no address of this machine for a port in
    use, and could disagree with llama-server's own bind, whose failure Server.start explains
    (bind_error)."""
    return accepts_connections(_reachable(host), port)


def _reachable(host: str) -> str:
    """The address to connect to for a server bound to host (a wildcard: loopback)."""
    return "127.0.0.1" if host in ("", "0.0.0.0") else "::1" if host == "::" else host


def bind_error(host: str, port: int, share_port: bool = True) -> OSError | None:
    """The error a bind as llama-server's (SO_REUSEPORT, where there is one) gets now, if any: once
    the server has exited during start-up, why it could not listen. share_port=False binds as
    ggml's rpc-server does (SO_REUSEADDR only), which a listening socket refuses."""
    family = socket.AF_INET6 if ":" in _reachable(host) else socket.AF_INET
    option = getattr(socket, "SO_REUSEPORT", socket.SO_REUSEADDR) if share_port else socket.SO_REUSEADDR
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, option, 1)
        try:
            sock.bind((host.strip("[]"), port))
        except OSError as e:
            return e
    return None


def end_with(parent: int) -> Callable[[], None] | None:
    """For Popen's preexec_fn: on Linux, the server gets SIGTERM when its parent dies, however it dies
    (SIGKILL, the OOM killer, a crash), so it never outlives us holding the port and the memory.
    The signal follows the thread that started the server: start it from a thread that lives as
    long as the server should."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)

    def set_parent_death_signal() -> None:
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the prctl
            os._exit(1)

    return set_parent_death_signal


WORKDIR_PREFIX = "ikdflash-server-"  # then the pid of the process that started the server


def remove_orphaned_workdirs() -> None:
    """Remove the folders of servers whose starting process is gone: one killed outright (SIGKILL)
    could not remove its server's folder, and its server ended with it (end_with)."""
    for folder in Path(tempfile.gettempdir()).glob(f"{WORKDIR_PREFIX}*-*"):
        pid = folder.name[len(WORKDIR_PREFIX):].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except (PermissionError, OverflowError):  # alive, another user's; not a pid
            pass


# llama-server flags whose value is a path. The server runs in another folder (see Server.start),
# so a relative path given to one of these is passed on as an absolute one; other values (an
# --alias that happens to name a file here) stay as they are.
PATH_FLAGS = frozenset({
    "--model-draft", "-md", "--spec-draft-model", "--lora", "--lora-scaled", "--control-vector",
    "--control-vector-scaled", "--mmproj",
    "--slot-save-path", "--grammar-file", "--chat-template-file", "--log-file", "--api-key-file",
    "--ssl-key-file", "--ssl-cert-file", "--json-schema-file",
})


def take_api_keys(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """(args without their `--api-key K` / `--api-key=K`, the keys): a key on the command line is
    visible to every user of the machine in /proc/*/cmdline, so Server moves it into a file."""
    rest: list[str] = []
    keys: list[str] = []
    args = list(args)
    while args:
        arg = args.pop(0)
        if arg == "--api-key" and args:
            keys.append(args.pop(0))
        elif arg.startswith("--api-key="):
            keys.append(arg.partition("=")[2])
        else:
            rest.append(arg)
    return rest, keys


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def absolute_paths(args: Sequence[str]) -> list[str]:
    """args with the values of PATH_FLAGS (as `--flag value` or `--flag=value`) made absolute."""
    out: list[str] = []
    for arg in args:
        flag, eq, value = arg.partition("=")
        if out and out[-1] in PATH_FLAGS:
            arg = os.path.abspath(arg)
        elif eq and flag in PATH_FLAGS:
            arg = f"{flag}={os.path.abspath(value)}"
        out.append(arg)
    return out


# llama-server's OpenMP threads spin up to GOMP_SPINCOUNT times (libgomp's default 300,000) at a
# barrier before they sleep. Beside one CPU-bound process on a 2-core machine, threads spinning for a
# partner that was not running held a request for as long as that process ran; alone, 1,000 spins
# were within the noise of the default (docs/server.md, "A busy machine").
OPENMP_SPIN_COUNT = "1000"


def openmp_defaults(env: Mapping[str, str]) -> dict[str, str]:
    """What a server's environment env gains: the spin count above, unless env says how OpenMP
    threads wait."""
    return {} if "GOMP_SPINCOUNT" in env or "OMP_WAIT_POLICY" in env else {"GOMP_SPINCOUNT": OPENMP_SPIN_COUNT}


class Server:
    """One llama-server process serving ``model``; a context manager yielding its base URL."""

    def __init__(self, model: str | os.PathLike[str], *, ctx_size: int = 4096, host: str = "127.0.0.1",
                 port: int = 0, n_threads: int | None = None, extra_args: Sequence[str] = (),
                 log_file: str | os.PathLike[str] | None = None, log_to_stdout: bool = False,
                 startup_timeout: float = 120.0, stop_grace: float = 10.0,
                 on_wait: Callable[[float], None] | None = None, env: Mapping[str, str] | None = None,
                 api_key: str | None = None, binary: str | os.PathLike[str] | None = None) -> None:
        self.model = Path(model)
        rules.port(port)
        self.binary = Path(binary) if binary else None  # another llama-server build (benchmarks); default the fork's
        self.host = host
        self.port = port
        self.ctx_size = ctx_size
        self.n_threads = n_threads
        # API keys (api_key, and any --api-key in extra_args) reach the server through a private
        # file that exists only while it starts: never on its command line.
        self.extra_args, self.api_keys = take_api_keys(extra_args)
        self.api_keys = ([api_key] if api_key else []) + self.api_keys
        if any(not key.strip() or "\n" in key for key in self.api_keys):
            raise ValueError("an API key must be one non-blank line")
        self._key_file: Path | None = None
        self.log_file = Path(log_file) if log_file else None
        self.log_to_stdout = log_to_stdout  # the server's log goes to our stdout (when no log_file)
        self.on_wait = on_wait              # called with the seconds waited, while starting
        self.env = dict(env or {})          # set for the server process, over ours (environment())
        self.startup_timeout = startup_timeout
        self.stop_grace = stop_grace
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._output: _Output | None = None
        self._workdir: Path | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        """The exact llama-server command line (port resolved when start() runs)."""
        cmd = [str(self.binary or server_binary()), "-m", str(self.model.resolve()), "-c", str(self.ctx_size),
               "--host", self.host, "--port", str(self.port)]
        if self.n_threads:
            cmd += ["-t", str(self.n_threads)]
        if self.api_keys:
            cmd += ["--api-key-file", str(self._key_file or "<a private file written at start>")]
        return cmd + absolute_paths(self.extra_args)

    def environment(self) -> dict[str, str]:
        """The server process's environment: ours, then env, then openmp_defaults."""
        env = {**os.environ, **self.env}
        return {**env, **openmp_defaults(env)}

    def environment_changes(self) -> dict[str, str]:
        """What the server's environment sets over ours (a dry run prints them before the command)."""
        return {key: value for key, value in self.environment().items() if os.environ.get(key) != value}

    @property
    def requires_key(self) -> bool:
        return bool(self.api_keys) or any(a.partition("=")[0] == "--api-key-file" for a in self.extra_args)

    # --- lifecycle -------------------------------------------------------------------------
    def start(self) -> str:
        if self.process is not None:
            raise ServerError("server already started")
        if not self.model.is_file():
            raise FileNotFoundError(f"model file not found: {self.model}")
        if self.port == 0:
            self.port = free_port(self.host)
        elif port_in_use(self.host, self.port):
            raise ServerError(f"port {self.port} on {self.host} is already in use; pick another or use port 0")
        try:
            if self.log_file:
                self._log = open(self.log_file, "wb")
            # Own process group, so stop() reaches anything the server spawns; run in a folder of
            # its own, removed at stop, as the server also writes a llama.log where it runs.
            remove_orphaned_workdirs()
            self._workdir = Path(tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-"))
            self._write_key_file()
            self.process = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, start_new_session=True, cwd=self._workdir,
                                            env=self.environment(), preexec_fn=end_with(os.getpid()))
            assert self.process.stdout is not None
            self._output = _Output(self.process.stdout, self._log, self.log_to_stdout)
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        finally:
            self._remove_key_file()  # read by the server while it parsed its arguments
        return self.url

    def _write_key_file(self) -> None:
        if self.api_keys:
            fd, name = tempfile.mkstemp(prefix="ikdflash-api-key-")  # mode 0600: this user only
            with os.fdopen(fd, "w") as f:
                f.write("".join(key + "\n" for key in self.api_keys))
            self._key_file = Path(name)

    def _remove_key_file(self) -> None:
        if self._key_file is not None:
            self._key_file.unlink(missing_ok=True)
            self._key_file = None

    def _wait_ready(self) -> None:
        assert self.process is not None
        start = time.monotonic()
        deadline = start + self.startup_timeout
        while time.monotonic() < deadline:
            if self.on_wait is not None:
                self.on_wait(time.monotonic() - start)
            code = self.process.poll()
            if code is not None:
                error = bind_error(self.host, self.port)
                if error is not None and error.errno == errno.EADDRINUSE:
                    raise ServerError(f"port {self.port} on {self.host} is already in use; pick another or use port 0")
                if error is not None:
                    raise ServerError(f"llama-server could not listen on {self.host}:{self.port}: "
                                      f"{error.strerror or error}")
                raise self._refusal(f"llama-server exited with code {code} during start-up")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet, or still loading (503)
            time.sleep(0.1)
        raise self._refusal(f"llama-server not ready after {self.startup_timeout:.0f}s")

    def _refusal(self, what: str) -> ServerError:
        """A ServerError saying what happened and, in llama-server's own words, why."""
        if self._output is not None and self.process is not None and self.process.poll() is not None:
            self._output.join(timeout=5)  # the pipe ends with the process: every line is in
        reason = refusal_reason(self._output.lines) if self._output is not None else None
        where = f" (whole log: {self.log_file})" if self.log_file else ""
        return ServerError(f"{what}: {reason}{where}" if reason else f"{what}{where}", reason)

    def stop(self) -> int | None:
        """Stop the server and reap it; returns its exit code (None if it was not running)."""
        process, self.process = self.process, None
        code = None
        if process is not None:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(timeout=self.stop_grace)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
            code = process.returncode
        if self._output is not None:
            self._output.join(timeout=5)
            self._output = None
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
        if self._log is not None:
            self._log.close()
            self._log = None
        return code

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

