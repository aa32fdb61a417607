"""Why `--spec-type dflash` refuses `--parallel` above 1: the base server's own speculative
decoding (a classic draft model, no DFlash involved) stops reproducing plain greedy decoding once
two slots verify drafts in the same batch.

    python benchmarks/parallel_slots.py [--rounds 6] [--flash-attn off|on]

A tiny llama target and another tiny llama (different weights) as its draft, so drafts are
mostly rejected. The two prompts are decoded one at a time without a draft (the reference), then
sent concurrently, several rounds, to a server with --parallel 2 and the draft. It prints, per
round, whether each reply equals its reference; the same rounds with --parallel 1 (requests
queued) all match.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
from pathlib import Path

from ikdflash import Server
from ikdflash.client import post_json
from ikdflash.tinymodels import write_tiny_model

PROMPTS = ["the quick brown fox jumps over the lazy dog, and the cat sat on the mat. " * 3,
           "once upon a time there was a little server that could. " * 3]


def concurrent_replies(url: str, bodies: list[dict]) -> list[str]:
    replies = [""] * len(bodies)

    def send(i: int) -> None:
        replies[i] = post_json(url + "/completion", bodies[i])["content"]

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return replies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--flash-attn", choices=["off", "on"], default="off")
    args = parser.parse_args()
    bodies = [{"prompt": p, "n_predict": 64, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
              for p in PROMPTS]
    with tempfile.TemporaryDirectory() as tmp:
        target = write_tiny_model(Path(tmp) / "target.gguf", arch="llama")
        draft = write_tiny_model(Path(tmp) / "draft.gguf", arch="llama", seed=7)
        common = ["-fa", args.flash_attn]
        with Server(target, ctx_size=1024, n_threads=2, extra_args=common) as url:
            reference = [post_json(url + "/completion", b)["content"] for b in bodies]
        for parallel in (1, 2):
            extra = common + ["--parallel", str(parallel), "--model-draft", str(draft), "--draft-max", "4"]
            with Server(target, ctx_size=1024 * parallel, n_threads=2, extra_args=extra) as url:
                matches = [concurrent_replies(url, bodies) == reference for _ in range(args.rounds)]
            print(f"--parallel {parallel}: {sum(matches)}/{len(matches)} rounds equal to plain decoding "
                  f"({' '.join('=' if m else 'x' for m in matches)})")


if __name__ == "__main__":
    main()
