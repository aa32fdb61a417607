"""Acceptance after each llama-server path that rewrites a slot's cache, against a fresh request
for the same tokens, on the built-in pair (SmolLM2-135M-Instruct and its sliding-window draft).

    python -m benchmarks.server paths [--prompts 8] [--json out.json]

Per held-out chat prompt P (ShareGPT first turns, plain system prompt):
  edit          P, its answer (up to 160 tokens), then P + the first 60 answer tokens: the server
                truncates the draft's rings after they wrapped (window 128)
  ram-cache     P and its answer, another prompt (P goes to the RAM cache), then P + answer +
                a follow-up turn (P comes back from the cache)
  slot-restore  the same with /slots save and restore instead of the RAM cache
Each final prompt is then sent to a fresh server (no cache): the draft accepts about as many
tokens on a path as fresh when it kept the right context. Text identity is reported too; it can
differ on near-ties, as reused cells were computed in other batches than a fresh prompt's.
Prompts are token ids built from the target's own answer ids, so both see one sequence.
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
from pathlib import Path

from ikdflash import Server
from ikdflash.chat import chat_template, render
from ikdflash.serving.client import post_json
from ikdflash.sources.references import DEFAULT_PAIR, resolve_pair
from ikdflash.model import Model
from ikdflash.serving.spectype import SpecType
from ikdflash.train.corpus import read_conversations

from benchmarks.harness import SYSTEM, write_result

FOLLOW_UP = "Can you say more about that?"
OTHER = "Write a short poem about a lighthouse keeper and the sea at night."
PATHS = ("edit", "ram-cache", "slot-restore")


def request(url: str, prompt: list[int], n_predict: int, **extra) -> dict:
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "cache_prompt": True, **extra}
    return post_json(url + "/completion", body)


class Conversation:
    """A held-out question, its greedy answer as the target's ids, and the turn after it."""

    def __init__(self, model: Model, template: str, question: str, answer_tokens: int) -> None:
        def tokens(text: str) -> list[int]:
            return model.tokenize(text, add_special=False, parse_special=True)

        turns = [("system", SYSTEM), ("user", question)]
        first = render(template, turns, add_generation_prompt=True)
        self.prompt = tokens(first)
        self.answer = model.generate(self.prompt, max_tokens=answer_tokens).tokens
        reply = model.detokenize(self.answer).decode(errors="replace")
        after = render(template, [*turns, ("assistant", reply), ("user", FOLLOW_UP)], add_generation_prompt=True)
        # only the new text is tokenized: the answer's text re-tokenized could split differently
        self.continued = (self.prompt + self.answer + tokens(after[len(first + reply):])
                          if after.startswith(first + reply) else None)


def run_path(path: str, url: str, conv: Conversation, other: list[int]) -> tuple[list[int], dict]:
    """Drive one path on a DFlash server; (final prompt, its reply)."""
    request(url, conv.prompt, len(conv.answer) + 1)
    if path == "edit":
        final = conv.prompt + conv.answer[:60]
    else:
        if path == "slot-restore":
            post_json(url + "/slots/0?action=save", {"filename": "p.bin"})
        request(url, other, 32, ignore_eos=True)
        if path == "slot-restore":
            post_json(url + "/slots/0?action=restore", {"filename": "p.bin"})
        final = conv.continued
    return final, request(url, final, 64, ignore_eos=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    target, draft = resolve_pair(DEFAULT_PAIR)
    spec = ["--model-draft", str(draft), "--spec-type", SpecType(n_max=4, adaptive=False).flag()]
    template = chat_template(target)
    totals = {p: {"path": [0, 0], "fresh": [0, 0], "same_text": 0, "n": 0} for p in args.paths}
    with Model(target, n_ctx=2048, n_threads=2) as model, tempfile.TemporaryDirectory() as tmp:
        other = model.tokenize(render(template, [("system", SYSTEM), ("user", OTHER)], add_generation_prompt=True),
                               add_special=False, parse_special=True)
        questions = (c.first_user_turn for c in read_conversations() if c.held_out and len(c.first_user_turn) < 600)
        convs = [Conversation(model, template, q, 160) for q in itertools.islice(questions, args.prompts * 3)]
        convs = [c for c in convs if len(c.answer) >= 100 and c.continued is not None][:args.prompts]
        print(f"{len(convs)} held-out prompts with answers of 100+ tokens")
        for path in args.paths:
            extra = ["--slot-save-path", tmp, "--cache-ram", "0"] if path == "slot-restore" else []
            finals = []
            with Server(target, ctx_size=2048, n_threads=2, extra_args=[*extra, *spec]) as url:
                for conv in convs:
                    final, reply = run_path(path, url, conv, other)
                    finals.append((final, reply))
            with Server(target, ctx_size=2048, n_threads=2, extra_args=[*spec, "--cache-ram", "0"]) as url:
                for final, reply in finals:
                    fresh = request(url, final, 64, ignore_eos=True, cache_prompt=False)
                    t = totals[path]
                    for key, r in (("path", reply), ("fresh", fresh)):
                        t[key][0] += r["timings"]["draft_n_accepted"]
                        t[key][1] += r["timings"]["draft_n"]
                    t["same_text"] += reply["content"] == fresh["content"]
                    t["n"] += 1
    print(f"{'path':14} {'accepted/drafted on the path':>30} {'fresh':>16} {'ratio':>6} {'same text':>10}")
    for path, t in totals.items():
        (pa, pd), (fa, fd) = t["path"], t["fresh"]
        ratio = (pa / max(pd, 1)) / max(fa / max(fd, 1), 1e-9)
        print(f"{path:14} {pa:>14}/{pd:<6} {pa / max(pd, 1):6.1%} {fa:>7}/{fd:<5} {fa / max(fd, 1):5.1%} "
              f"{ratio:6.2f} {t['same_text']:>5}/{t['n']}")
    if args.json:
        write_result(args.json, totals, threads=2)
