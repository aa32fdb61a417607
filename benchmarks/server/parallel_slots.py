"""Two concurrent speculative requests on two slots of the packaged llama-server, against plain
greedy decoding, with the base's classic draft-model speculation (no DFlash involved).

    python -m benchmarks.server parallel-slots [--rounds 6] [--flash-attn off|on]

A tiny llama target and another tiny llama (different weights) as its draft, so most drafts are
rejected and each rejection leaves a hole in the KV cache under the other slot's cells. The two
prompts are decoded one at a time without a draft (the reference), then sent concurrently,
several rounds, with --parallel 1 (queued) and --parallel 2 (verified in the same batches). It
prints per round whether both replies equal the reference. Before patch `kv-cache-the-last-used-cell-is-found-past-holes` (the KV
cache's last-used-cell search skipped cells above a hole) --parallel 2 missed in some rounds; the DFlash
equivalent is tests/test_server_dflash.py::test_concurrent_requests_are_lossless.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from ikdflash import Server
from ikdflash.serving.client import post_json, post_json_concurrently
from tests.fixtures.tinymodels import write_tiny_model

PROMPTS = ["the quick brown fox jumps over the lazy dog, and the cat sat on the mat. " * 3,
           "once upon a time there was a little server that could. " * 3]


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
                matches = [[r["content"] for r in post_json_concurrently(url + "/completion", bodies)] == reference
                           for _ in range(args.rounds)]
            print(f"--parallel {parallel}: {sum(matches)}/{len(matches)} rounds equal to plain decoding "
                  f"({' '.join('=' if m else 'x' for m in matches)})")
