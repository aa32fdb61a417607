"""Supervise the packaged llama-server: start, wait until ready, stop; never leave an orphan.

    from ikdflash import Server, complete
    with Server("target.gguf", ctx_size=4096) as url:
        print(complete(url, "Hello", max_tokens=16).text)

The process has four states: stopped -> starting -> ready -> stopped. Start polls /health
until a deadline and fails at once if the child exits early; stop sends SIGTERM to the
process group, waits a grace period, then SIGKILL.
"""

from __future__ import annotations

import ctypes
import errno
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Callable, Mapping, Sequence

from ikdflash.serving.fork import server_binary


class ServerError(RuntimeError):
    """llama-server could not be started, or died."""


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


def bind_error(host: str, port: int) -> OSError | None:
    """The error a bind as llama-server's (SO_REUSEPORT, where there is one) gets now, if any: once
    the server has exited during start-up, why it could not listen."""
    family = socket.AF_INET6 if ":" in _reachable(host) else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_REUSEPORT", socket.SO_REUSEADDR), 1)
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


class Server:
    """One llama-server process serving ``model``; a context manager yielding its base URL."""

    def __init__(self, model: str | os.PathLike[str], *, ctx_size: int = 4096, host: str = "127.0.0.1",
                 port: int = 0, n_threads: int | None = None, extra_args: Sequence[str] = (),
                 log_file: str | os.PathLike[str] | None = None, log_to_stdout: bool = False,
                 startup_timeout: float = 120.0, stop_grace: float = 10.0,
                 on_wait: Callable[[float], None] | None = None, env: Mapping[str, str] | None = None,
                 api_key: str | None = None, binary: str | os.PathLike[str] | None = None) -> None:
        self.model = Path(model)
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
        self.env = dict(env or {})          # set for the server process, over ours
        self.startup_timeout = startup_timeout
        self.stop_grace = stop_grace
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

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
        if self.log_file:
            self._log = open(self.log_file, "wb")
        # Own process group, so stop() reaches anything the server spawns; run beside its log
        # (or in the temp folder), as the server also writes a llama.log where it runs.
        workdir = self.log_file.parent if self.log_file else tempfile.gettempdir()
        output = self._log or (None if self.log_to_stdout else subprocess.DEVNULL)
        try:
            self._write_key_file()
            self.process = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=output,
                                            stderr=subprocess.STDOUT, start_new_session=True, cwd=workdir,
                                            env={**os.environ, **self.env}, preexec_fn=end_with(os.getpid()))
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
                raise ServerError(f"llama-server exited with code {code} during start-up{self._log_hint()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet, or still loading (503)
            time.sleep(0.1)
        raise ServerError(f"llama-server not ready after {self.startup_timeout:.0f}s{self._log_hint()}")

    def _log_hint(self) -> str:
        if self.log_file is None:
            return " (pass log_file= to keep its log)"
        tail = self.log_file.read_bytes()[-1500:].decode("utf-8", errors="replace")
        return f"; last lines of {self.log_file}:\n{tail}"

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
        if self._log is not None:
            self._log.close()
            self._log = None
        return code

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

