"""Aggregate throughput of llama-server under load, with the built-in pair's DFlash draft against
without a draft.

    python -m benchmarks.server load [--slots 2 4] [--rounds 3] [--tokens 128] [--json out.json] [--lookup-off]
        [--other PATH/llama-server] [--useless] [--questions chat|held-out] [--waves [--turns round|wave]]
        [--fresh-servers] [--twin]

For each --slots N, the packaged llama-server starts with --parallel N twice, with the draft
(default --spec-type dflash: adaptive) and without. Both stay up, serve one warm-up run, then take
turns, in an order that alternates by round, so that the runs of a round are seconds apart on a
machine whose speed drifts.

A run is a steady load: the 8 chat questions, twice (greedy, the pair's system prompt, no prompt
cache), N requests in flight, each next one sent as soon as a reply comes back. The replies' lengths
are fixed and spread over --tokens/2 .. 3 --tokens/2 (ignore_eos), so that both servers generate
the same tokens whatever their batches' rounding, and the slots do not finish in lock-step, which
replies of one length would make them do without a draft and not with one (a synchronized server
turns its slots over all at once). --waves measures the earlier way instead: the 8 questions sent
N at a time, each wave after the one before has answered, every reply ending at its end-of-text
token or at --tokens. With --turns wave the servers take turns at every wave instead of every
round (the order rotating by wave), so that their runs interleave within seconds, and each one's
throughput is its tokens over the time of its own waves. Two llama-servers of the same build and
flags need not decode at the same speed for as long as they run, a few percent apart (a process's
speed follows where its memory lands; docs/benchmarks.md, "Turns by wave, and servers started
anew"), which turns between them do not cancel: --fresh-servers starts the servers anew for every
round, so that the rounds' median does.
--twin adds a second server without a draft, reported against the first like the others: the
spread two servers alike show.

A server's throughput is the tokens generated over the wall time from the first request sent to the
last reply. Reported per N: each round's ratio (draft / no draft), their median, the one-token
decodes the load chose (/metrics dflash_load_plain_steps_total), and the share of the wall time the
draft steps took (the replies' timings.draft_ms summed: a server runs its slots' draft steps one
after another).

--other adds a third server, another build's llama-server with the same draft and flags (e.g. one
before a change), in the same rotation, and reports it against the same plain runs; --lookup-off
one with the draft and the n-gram lookup off (--spec-type dflash:lookup=0). --useless serves the
draft reading the target's layers in reverse (benchmarks.adaptive's useless workload: the same
cost, next to nothing kept), to measure what DFlash costs where drafting never pays. --questions
held-out asks the 24 held-out chat questions of benchmarks/tau.py instead of the 8 above (with
--slots 1 --waves: the draft's own chat gain through llama-server, each reply the target's own).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

from ikdflash import Server
from ikdflash.serving.client import post_json_concurrently
from ikdflash.serving.spectype import SpecType
from ikdflash.sources.references import DEFAULT_PAIR, PAIR_CHAT_DEFAULTS, resolve_pair

from benchmarks.adaptive.workloads import scrambled_draft
from benchmarks.harness import write_result
from benchmarks.tau import held_out_questions

QUESTIONS = ["Explain rainbows to a child.", "What is the capital of France, and why is it famous?",
             "Give me three tips for learning to cook.", "Write a short poem about the sea.",
             "How do bees make honey?", "Why is the sky blue?",
             "Describe a good morning routine.", "What should I pack for a weekend hike?"]


# a server's draft, llama-server binary (None: the packaged one) and spec type (None: the default)
ServerConfig = tuple[Path | None, Path | None, SpecType | None]


def chat_bodies(tokens: int, questions: Sequence[str] = QUESTIONS) -> list[dict]:
    """The questions as greedy chat requests under the pair's system prompt, no prompt cache."""
    system = PAIR_CHAT_DEFAULTS[DEFAULT_PAIR]["system"]
    return [{"messages": [{"role": "system", "content": system}, {"role": "user", "content": q}],
             "max_tokens": tokens, "temperature": 0, "cache_prompt": False} for q in questions]


def steady_bodies(tokens: int, questions: Sequence[str]) -> list[dict]:
    """The questions twice, each reply running to a length of its own past its end-of-text token:
    --tokens/2 .. 3 --tokens/2, in an order that mixes them."""
    bodies = chat_bodies(tokens, questions) * 2
    spread = tokens + 1
    return [{**body, "max_tokens": tokens // 2 + (i * 37) % spread, "ignore_eos": True}
            for i, body in enumerate(bodies)]


def server_flags(draft: Path | None, slots: int, spec: SpecType | None = None) -> list[str]:
    """--parallel slots, with the draft at --spec-type spec (default: dflash) when one is given."""
    flags = ["--parallel", str(slots)]
    return flags if draft is None else flags + ["--model-draft", str(draft), "--spec-type", (spec or SpecType()).flag()]


def post_in_waves(route: str, bodies: list[dict], slots: int) -> list[dict]:
    """The bodies sent `slots` at a time, each wave after the one before has answered."""
    replies: list[dict] = []
    for at in range(0, len(bodies), slots):
        replies += post_json_concurrently(route, bodies[at:at + slots])
    return replies


def load_plain_steps(url: str) -> int:
    """The server's one-token decodes chosen for the load so far (0 without a draft)."""
    metrics = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    held = re.search(r"^llamacpp:dflash_load_plain_steps_total (\d+)", metrics, re.MULTILINE)
    return int(held.group(1)) if held else 0


def run_load(url: str, bodies: list[dict], slots: int, waves: bool = False) -> dict:
    """The bodies sent to a running server (started with --metrics), `slots` in flight (or in
    waves): its throughput."""
    held_before = load_plain_steps(url)
    start = time.monotonic()
    route = url + "/v1/chat/completions"
    replies = post_in_waves(route, bodies, slots) if waves else post_json_concurrently(route, bodies, in_flight=slots)
    return throughput(replies, time.monotonic() - start, load_plain_steps(url) - held_before)


def run_waves_in_turns(urls: dict[str, str], order: list[str], bodies: list[dict], slots: int) -> dict[str, dict]:
    """The bodies sent in waves of `slots` to every server, the servers taking turns at each wave
    (the order rotating by wave): each one's throughput over the time of its own waves."""
    held_before = {name: load_plain_steps(url) for name, url in urls.items()}
    replies: dict[str, list[dict]] = {name: [] for name in order}
    seconds = dict.fromkeys(order, 0.0)
    for wave, at in enumerate(range(0, len(bodies), slots)):
        for name in order[wave % len(order):] + order[:wave % len(order)]:
            start = time.monotonic()
            replies[name] += post_json_concurrently(urls[name] + "/v1/chat/completions", bodies[at:at + slots])
            seconds[name] += time.monotonic() - start
    return {name: throughput(replies[name], seconds[name], load_plain_steps(urls[name]) - held_before[name])
            for name in order}


def throughput(replies: list[dict], seconds: float, load_plain: int) -> dict:
    """A run's replies over its wall time: tokens per second, the share of it the draft steps took,
    and the prompt's speed."""
    generated = sum(r["usage"]["completion_tokens"] for r in replies)
    draft_ms = sum(r.get("timings", {}).get("draft_ms", 0.0) for r in replies)
    prompt_ms = sum(r.get("timings", {}).get("prompt_ms", 0.0) for r in replies)
    prompt_n = sum(r.get("timings", {}).get("prompt_n", 0) for r in replies)
    return {"tokens": generated, "seconds": seconds, "tokens_per_second": generated / seconds,
            "load_plain_steps": load_plain, "draft_share": draft_ms / 1e3 / seconds,
            "prompt_tokens_per_second": prompt_n / (prompt_ms / 1e3) if prompt_ms else None}


def start_server(target: Path, draft: Path | None, slots: int, binary: Path | None = None,
                 extra: Sequence[str] = (), spec: SpecType | None = None) -> Server:
    return Server(target, ctx_size=2048 * slots, extra_args=server_flags(draft, slots, spec) + ["--metrics", *extra],
                  binary=binary)


def serve_once(target: Path, draft: Path | None, slots: int, tokens: int, extra: Sequence[str] = ()) -> dict:
    """A server started for one run of the chat questions in waves."""
    with start_server(target, draft, slots, extra=extra) as url:
        return run_load(url, chat_bodies(tokens), slots, waves=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--other", type=Path, help="another llama-server build, run with the draft too")
    parser.add_argument("--lookup-off", action="store_true",
                        help="a third server per round: the draft with the n-gram lookup off (lookup=0)")
    parser.add_argument("--useless", action="store_true",
                        help="the draft reading the target's layers in reverse: drafting never pays")
    parser.add_argument("--questions", choices=("chat", "held-out"), default="chat")
    parser.add_argument("--waves", action="store_true",
                        help="the questions sent N at a time, each reply ending at its end-of-text token or --tokens")
    parser.add_argument("--turns", choices=("round", "wave"), default="round",
                        help="with --waves: the servers take turns at each round (default) or at each wave")
    parser.add_argument("--twin", action="store_true",
                        help="a server more, without a draft like plain: what two servers alike measure apart")
    parser.add_argument("--fresh-servers", action="store_true",
                        help="start the servers anew for every round (a process's speed depends on where its "
                             "memory lands)")
    args = parser.parse_args()
    if args.turns == "wave" and not args.waves:
        parser.error("--turns wave needs --waves")

    target, draft = resolve_pair(DEFAULT_PAIR)
    questions = QUESTIONS if args.questions == "chat" else held_out_questions(24)
    with tempfile.TemporaryDirectory() as tmp:
        if args.useless:
            draft = scrambled_draft(draft, Path(tmp) / "useless.gguf")
        results = measure(args, target, draft, questions)
    if args.json:
        write_result(args.json, {"tokens": args.tokens, "other": str(args.other) if args.other else None,
                                 "useless": args.useless, "questions": questions,
                                 "waves": args.waves, "turns": args.turns, "fresh_servers": args.fresh_servers,
                                 "slots": results},
                     os.cpu_count() or 1)


@contextlib.contextmanager
def serving(target: Path, configs: dict[str, ServerConfig], slots: int, bodies: list[dict],
            waves: bool) -> Iterator[dict[str, str]]:
    """A server per configuration (draft, binary, spec type), each warmed up by serving every slot
    once: their URLs by name."""
    with contextlib.ExitStack() as servers:
        urls = {name: servers.enter_context(start_server(target, draft, slots, binary, spec=spec))
                for name, (draft, binary, spec) in configs.items()}
        for url in urls.values():
            run_load(url, bodies[:slots], slots, waves)
        yield urls


def measure(args: argparse.Namespace, target: Path, draft: Path, questions: Sequence[str]) -> dict:
    """Per --slots N: every round's runs and ratios, and their medians. The servers stay up through
    the rounds (or start anew for each, --fresh-servers) and take turns, so that the runs of one
    round are seconds apart."""
    results = {}
    bodies = chat_bodies(args.tokens, questions) if args.waves else steady_bodies(args.tokens, questions)
    for slots in args.slots:
        rounds = []
        configs: dict[str, ServerConfig] = {"dflash": (draft, None, None), "plain": (None, None, None)}
        if args.other:
            configs["other"] = (draft, args.other, None)
        if args.lookup_off:
            configs["lookup=0"] = (draft, None, SpecType(lookup=False))
        if args.twin:
            configs["twin"] = (None, None, None)
        names = list(configs)
        with contextlib.ExitStack() as up:
            urls = {} if args.fresh_servers else up.enter_context(serving(target, configs, slots, bodies, args.waves))
            for r in range(args.rounds):
                fresh = serving(target, configs, slots, bodies, args.waves) if args.fresh_servers else None
                with fresh or contextlib.nullcontext(urls) as round_urls:
                    order = names[r % len(names):] + names[:r % len(names)]
                    if args.turns == "wave":
                        runs = run_waves_in_turns(round_urls, order, bodies, slots)
                    else:
                        runs = {name: run_load(round_urls[name], bodies, slots, args.waves) for name in order}
                ratios = {name: runs[name]["tokens_per_second"] / runs["plain"]["tokens_per_second"]
                          for name in names if name != "plain"}
                rounds.append({**runs, "ratios": ratios})
                print(f"--parallel {slots} round {r + 1}: " + ", ".join(
                    f"{name} {runs[name]['tokens_per_second']:.1f} tok/s" for name in names) + "; against plain " +
                      ", ".join(f"{name} {ratio:.3f}x" for name, ratio in ratios.items()) +
                      f" ({runs['dflash']['load_plain_steps']} steps held by load,"
                      f" drafting {runs['dflash']['draft_share']:.1%} of the wall time)", flush=True)
        medians = {name: statistics.median(r["ratios"][name] for r in rounds) for name in rounds[0]["ratios"]}
        print(f"--parallel {slots}: median against plain " + ", ".join(f"{n} {m:.3f}x" for n, m in medians.items()))
        results[str(slots)] = {"rounds": rounds, "median_ratios": medians}
    return results
