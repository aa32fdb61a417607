"""Start the packaged llama-server with a target and its DFlash draft, and supervise it.

    ikdflash serve                                                     # the built-in SmolLM2 pair
    ikdflash serve --target T.gguf --draft D.gguf                      # n_max 4, cross_ctx = -c
    ikdflash serve --target T.gguf --draft D.gguf -c 8192 --cross-ctx 8192 --port 8080
    ikdflash serve --target T.gguf --draft D.gguf --dry-run            # print the command only
    ikdflash serve --target owner/repo:Q4_K_M --draft owner/repo/draft.gguf   # hub references
    ikdflash serve --pair qwen3.5-35b-a3b-swa                           # a known pair (download)
    ikdflash serve --target T.gguf --draft D.gguf -- --metrics -fa on  # more llama-server flags
    ikdflash serve --target T.gguf --draft D.gguf --rpc H1:50052,H2:50052 --gpu-layers 40  # layers on workers
    IKDFLASH_API_KEY=... ikdflash serve --host 0.0.0.0                 # clients send the key

Before starting it checks that both files are GGUFs and that the draft matches the target, and
warns when the draft's sliding window can never engage. It prints the exact command, waits for
/health, streams the server's log (or writes it to --log-file), forwards Ctrl-C and SIGTERM,
and never leaves the server behind. An API key (IKDFLASH_API_KEY, --api-key-file, or
`-- --api-key K`) reaches the server through a file, never its command line; serving on a
non-loopback address without one gets a warning. Exit codes: 0 after a requested stop, 1 if the server
failed, 2 for bad input.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import time
from pathlib import Path

from ikdflash import rules
from ikdflash.cli.decoding import add_proposal_arguments
from ikdflash.sources.references import HubError, add_model_arguments, resolve_models
from ikdflash.model import repack_by_default
from ikdflash.sources.pair import check_pair
from ikdflash.serving.server import Server, ServerError, accepts_connections, free_port, is_loopback
from ikdflash.serving.spectype import SpecType, SpecTypeError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--n-max", type=int, default=4, help="draft tokens per step, at most: 1 up to what one "
                        "draft pass proposes (default 4)")
    parser.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True,
                        help="each step verifies as many of the --n-max drafts as pay on this machine, none when "
                             "drafting does not pay (default); --no-adaptive: every step verifies --n-max")
    add_proposal_arguments(parser)
    parser.add_argument("--cross-ctx", type=int, help="context rows the draft keeps (default: the context size)")
    parser.add_argument("--full-attention", action="store_true", help="ignore the draft's sliding windows")
    parser.add_argument("--min-accept", type=float, help="stop drafting for a request whose acceptance over its "
                        "last 16 steps falls below this fraction (default: never; a low one is logged)")
    parser.add_argument("-c", "--ctx-size", type=int, default=8192, help="context size (default 8192)")
    parser.add_argument("--gpu-layers", type=int, help="target layers on the GPU (llama-server -ngl)")
    parser.add_argument("--repack", action=argparse.BooleanOptionalAction, default=None,
                        help="repack the target's CPU weights at load (llama-server -rtr); default: where it keeps "
                             "results exact (Q4_1 and Q8_0 weights, a tied head, no --gpu-layers)")
    parser.add_argument("--gpu-layers-draft", type=int,
                        help="draft placement (-ngld): default follows the target's output layer, "
                             "0 keeps it on the CPU")
    parser.add_argument("--parallel", type=int, default=1, help="slots serving requests at once (default 1)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="a reply does not depend on the other slots' requests (CPU; slower: "
                             "docs/dflash.md#batch-invariance)")
    parser.add_argument("--rpc", metavar="HOST:PORT,...",
                        help="RPC workers (ikdflash rpc-worker) that hold the offloaded target layers (--gpu-layers); "
                             "keep the output layer here (--gpu-layers <= the target's layer count): the draft "
                             "borrows it")
    parser.add_argument("--alias", help="the model name the API reports (default: the target's file name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--api-key-file", type=Path,
                        help="file with the API key(s) clients must send, one per line "
                             "(or set IKDFLASH_API_KEY; /health stays open)")
    parser.add_argument("--port", type=int, default=8080, help="port, 0..65535; 0 for a free one (default 8080)")
    parser.add_argument("--jinja", action=argparse.BooleanOptionalAction, default=True,
                        help="the model's own Jinja chat template, which OpenAI tool calls (tools) need "
                             "(default; --no-jinja: the server's built-in templates)")
    parser.add_argument("--metrics", action=argparse.BooleanOptionalAction, default=True,
                        help="serve Prometheus metrics at /metrics (default; --no-metrics: 501 there)")
    parser.add_argument("--log-file", type=Path, help="write the server's log here instead of stdout")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for /health")
    parser.add_argument("--dry-run", action="store_true", help="print the llama-server command and exit")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more llama-server arguments")


def say(message: str) -> None:
    print(f"ikdflash serve: {message}", file=sys.stderr, flush=True)


def build_server(args: argparse.Namespace) -> Server:
    spec = SpecType(n_max=args.n_max, cross_ctx=args.cross_ctx, full_attention=args.full_attention,
                    min_accept=args.min_accept, adaptive=None if args.adaptive else False,
                    lookup=None if args.lookup else False, confidence=args.confidence,
                    conf_min=args.conf_min or None)
    extra = ["--model-draft", str(args.draft.resolve()), "--spec-type", spec.flag()]
    if args.parallel != 1:
        extra += ["--parallel", str(args.parallel)]
    if args.batch_invariant:
        extra.append("--batch-invariant")
    extra += [flag for flag, on in (("--jinja", args.jinja), ("--metrics", args.metrics))
              if on and flag not in args.extra]
    if args.alias:
        extra += ["--alias", args.alias]
    if args.gpu_layers is not None:
        extra += ["-ngl", str(args.gpu_layers)]
    repack = args.repack if args.repack is not None else repack_by_default(args.target, args.gpu_layers or 0)
    if repack:
        extra += ["-rtr"]
    if args.rpc:
        extra += ["--rpc", ",".join(_check_rpc_workers(args.rpc))]
    if args.gpu_layers_draft is not None:
        extra += ["-ngld", str(args.gpu_layers_draft)]
    if args.api_key_file is not None:
        _check_key_file(args.api_key_file)
        extra += ["--api-key-file", str(args.api_key_file)]
    passed_on = [a for a in args.extra if a != "--"]
    check_passed_on(passed_on)
    extra += passed_on
    last_report = [0.0]

    def progress(waited: float) -> None:
        if waited - last_report[0] >= 5.0:
            last_report[0] = waited
            say(f"waiting for llama-server to load the models ({waited:.0f}s)")

    return Server(args.target, ctx_size=args.ctx_size, host=args.host, port=args.port, extra_args=extra,
                  log_file=args.log_file, log_to_stdout=args.log_file is None,
                  startup_timeout=args.startup_timeout, on_wait=progress,
                  api_key=os.environ.get("IKDFLASH_API_KEY") or None)


def check_passed_on(extra: list[str]) -> None:
    """The llama-server arguments after -- that can be checked here, so that a mistake in them is
    refused before anything is loaded: a DFlash --spec-type's keys and values, and the port."""
    for flag, value in zip(extra, extra[1:]):
        if flag == "--spec-type" and value.partition(":")[0] == "dflash":
            SpecType.parse(value)
        elif flag == "--port":
            try:
                rules.port(int(value), name="--port")
            except ValueError:
                raise ValueError(f"--port must be in 0..65535 (0: a free one), got {value!r}") from None


def _check_rpc_workers(spec: str) -> list[str]:
    """host:port endpoints, each listening: llama-server itself only says it could not connect."""
    workers = [w.strip() for w in spec.split(",") if w.strip()]
    for worker in workers:
        host, _, port = worker.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--rpc {worker!r}: expected HOST:PORT")
        if not accepts_connections(host, int(port), timeout=3):
            raise ValueError(f"--rpc {worker}: no RPC worker listens there; start one with "
                             f"`ikdflash rpc-worker --host {host} --port {port}` on that machine")
    if not workers:
        raise ValueError("--rpc: no worker given")
    return workers


def _check_key_file(path: Path) -> None:
    try:
        keys = [line for line in path.read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--api-key-file {path}: cannot read it: {e}") from None
    if not keys:
        raise ValueError(f"--api-key-file {path}: the file holds no key (one per line)")


def run(args: argparse.Namespace) -> int:
    try:
        rules.at_least_one(args.ctx_size, "--ctx-size")
        rules.at_least_one(args.parallel, "--parallel")
        rules.port(args.port, "--port")
        rules.cross_ctx(args.cross_ctx, "--cross-ctx")
        rules.n_max(args.n_max, None, name="--n-max")  # its upper bound once the draft is read
        if not args.startup_timeout > 0:
            raise ValueError(f"--startup-timeout must be > 0 seconds, got {args.startup_timeout}")
        args.target, args.draft = resolve_models(args)
        server = build_server(args)
        report = check_pair(args.target, args.draft, cross_ctx=args.cross_ctx, ctx_size=args.ctx_size)
        if "max_proposal" in report.facts:
            rules.n_max(args.n_max, report.facts["max_proposal"], name="--n-max")
    except (SpecTypeError, HubError, FileNotFoundError, ValueError) as e:
        say(f"error: {e}")
        return 2
    for problem in report.problems:
        say(f"error: {problem}")
    if report.problems:
        return 2
    for warning in report.warnings:
        say(f"warning: {warning}")
    if not is_loopback(server.host) and not server.requires_key:
        say(f"warning: serving on {server.host} without an API key: anyone who can reach the port can use "
            "the server; set IKDFLASH_API_KEY or --api-key-file")
    if args.dry_run:
        print(" ".join([*(f"{key}={shlex.quote(value)}" for key, value in server.environment_changes().items()),
                        shlex.join(server.command())]))
        return 0

    def request_stop(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM and SIGHUP (a closed terminal) stop the server as Ctrl-C does

    # SIGINT too, explicitly: a process started in the background of a script inherits SIGINT
    # ignored, and Python then installs no handler of its own, so Ctrl-C / kill -INT did nothing
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, request_stop)
    if server.port == 0:
        server.port = free_port(server.host)
    say(f"command: {shlex.join(server.command())}")
    try:
        try:
            url = server.start()
        except ServerError as e:
            say(f"error: {e}")
            return 1
        say(f"ready at {url} (Ctrl-C to stop)")
        process = server.process
        assert process is not None
        while process.poll() is None:
            time.sleep(0.2)
        say(f"error: llama-server exited with code {process.returncode}")
        return 1
    except KeyboardInterrupt:
        say("stopping llama-server")
        return 0
    finally:
        server.stop()
