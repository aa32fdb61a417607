"""Run a ggml RPC worker that holds some of a target's layers for llama-server on another machine.

    ikdflash rpc-worker                                  # 127.0.0.1:50052, the CPU
    ikdflash rpc-worker --host 10.0.0.7 --port 50052     # reachable from the serving machine
    ikdflash serve --target T.gguf --draft D.gguf --rpc 10.0.0.7:50052,10.0.0.8:50052 --gpu-layers 40

The worker is the packaged rpc-server (built from the fork): it offers its GPUs, or its CPU when
it has none, and llama-server puts the offloaded layers on the workers it is given (--rpc).
The RPC protocol has no authentication and no encryption: bind it to a private network only.
Use it when the model does not fit one machine; for more traffic, run whole replicas instead
(docs/server.md). It runs until Ctrl-C or SIGTERM; exit codes: 0 after a requested stop, 1 if the
worker failed, 2 for bad input.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import subprocess
import sys
import time

from ikdflash.serving.fork import server_binary
from ikdflash.serving.server import bind_error, end_with, is_loopback, port_in_use

DEFAULT_PORT = 50052


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    parser.add_argument("--threads", type=int, help="CPU threads when the worker computes on its CPU")


def say(message: str) -> None:
    print(f"ikdflash rpc-worker: {message}", file=sys.stderr, flush=True)


def command(host: str, port: int, threads: int | None) -> list[str]:
    cmd = [str(server_binary("rpc-server")), "--host", host, "--port", str(port)]
    return cmd + (["--threads", str(threads)] if threads else [])


def port_taken(host: str, port: int) -> bool:
    """Whether a worker (or anything) holds the port. rpc-server's listen backlog is one, so while it
    serves a client a connection can go unanswered: its own bind's refusal is asked as well."""
    refusal = bind_error(host, port, share_port=False)
    return (refusal is not None and refusal.errno == errno.EADDRINUSE) or port_in_use(host, port)


def run(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536 or (args.threads is not None and args.threads < 1):
        say("error: --port must be 1-65535 and --threads at least 1")
        return 2
    if port_taken(args.host, args.port):
        say(f"error: {args.host}:{args.port} is already in use (another worker?); choose another --port")
        return 2
    if not is_loopback(args.host):
        say(f"warning: listening on {args.host}: RPC has no authentication; anyone who reaches the port can use "
            "this machine's memory and compute")

    def request_stop(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, request_stop)
    # the worker follows this process if it dies (SIGKILL, a crash): no orphan holds the port
    worker = subprocess.Popen(command(args.host, args.port, args.threads), preexec_fn=end_with(os.getpid()))
    try:
        while worker.poll() is None and not port_in_use(args.host, args.port):
            time.sleep(0.1)
        if worker.poll() is None:
            say(f"ready at {args.host}:{args.port} (Ctrl-C to stop)")
        code = worker.wait()
        say(f"error: rpc-server exited with code {code}")
        return 1
    except KeyboardInterrupt:
        say("stopping rpc-server")
        return 0
    finally:
        if worker.poll() is None:
            worker.terminate()
            try:
                worker.wait(timeout=10)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
