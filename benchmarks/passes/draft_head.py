"""The built-in pair's draft step with its head as shipped against cut to the ids the data uses most
(dflash.head_token_ids), per number of tokens proposed, and what the cut does to acceptance.

    python -m benchmarks.passes draft-head [--ids 16384 8192] [--tokens 96] [--repeats 3] [--keep DIR] [--json out.json]
    python -m benchmarks.passes draft-head --ids --draft dflash2=runs/d2/train/draft.gguf   # another draft's step
    python -m benchmarks.passes draft-head --ids --requantize Q4_1 --keep DIR             # the draft in Q4_1

The cut is the --ids most frequent ids of the target's own greedy tokens over training
conversations (never the held-out ones), written into a copy of the shipped draft; when the
shipped draft's head is cut already, only among its ids (a trained head never learnt to score the
others low). --keep DIR keeps the copies there (cut-N.gguf), e.g. to ship one. Each draft
speculates greedily on chat questions at fixed n_max 1..4 (a step proposes n_max tokens); the
drafts take turns within each repeat, in one process, and the medians of draft milliseconds per
step are reported with acceptance: compare ratios, not absolute times (shared, noisy machines).
--draft NAME=PATH adds a draft of the same pair to the comparison (a DFlash2 draft, say);
--requantize TYPE the shipped draft with its Q8_0 matrices requantized to TYPE (lossy on lossy;
--keep keeps it, e.g. for benchmarks/tau.py).
--conv-ops adds the shipped DFlash2 draft with its in-block convolutions as standard ggml ops, as
an accelerator runs them (IKDFLASH_DFLASH2_CONV_OPS=1), against one host node each (the CPU's).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import gguf
import numpy as np
from ikdflash import Engine
from ikdflash.chat import chat_template, render
from ikdflash.sources.references import DEFAULT_PAIR, resolve_pair
from ikdflash.model import Model
from ikdflash.train.corpus import read_conversations

from benchmarks.harness import QUESTIONS, chat_prompts  # the same chat questions under the same system prompt
from tests.fixtures.gguf_edit import rewrite
from benchmarks.harness import write_result


def frequent_ids(target: Path, n_conversations: int = 200) -> np.ndarray:
    """Ids by how often the target emits them greedily over training conversations, most first."""
    template = chat_template(target)
    with Model(target, n_ctx=1024) as model:
        counts = np.zeros(model.n_vocab, dtype=np.int64)
        done = 0
        for conv in read_conversations(None):
            if conv.held_out:
                continue
            text = render(template, list(conv.messages))
            tokens = model.tokenize(text, add_special=False, parse_special=True)[:1024]
            _, greedy = model.layer_features(tokens, [])
            counts += np.bincount(greedy, minlength=model.n_vocab)
            done += 1
            if done == n_conversations:
                break
    return np.argsort(-counts, kind="stable")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ids", type=int, nargs="*", default=[16384, 8192])
    parser.add_argument("--draft", action="append", default=[], metavar="NAME=PATH",
                        help="another draft for the built-in target to time beside the shipped one")
    parser.add_argument("--requantize", nargs="*", default=[], metavar="TYPE",
                        help="also time the shipped draft with its Q8_0 matrices requantized (Q4_0, Q4_1, ...)")
    parser.add_argument("--conv-ops", action="store_true",
                        help="also time the shipped DFlash2 draft with its convolutions as standard ggml ops")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keep", type=Path, help="write the cut drafts here (default: a temporary folder)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    target, shipped = resolve_pair(DEFAULT_PAIR)
    fields = gguf.GGUFReader(shipped).fields
    key = f"{fields['general.architecture'].contents()}.dflash.head_token_ids"  # either layout
    ranked = frequent_ids(target) if args.ids else np.arange(0)
    if key in fields:
        ranked = ranked[np.isin(ranked, np.asarray(fields[key].contents()))]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) if args.keep is None else args.keep
        folder.mkdir(parents=True, exist_ok=True)
        drafts = {"shipped": shipped}
        for n in args.ids:
            drafts[f"cut {n}"] = rewrite(shipped, folder / f"cut-{n}.gguf",
                                         fields={key: sorted(int(i) for i in ranked[:n])})
        for name in args.requantize:
            drafts[name] = rewrite(shipped, folder / f"requantized-{name}.gguf",
                                   requantize=gguf.GGMLQuantizationType[name.upper()])
        for named in args.draft:
            name, _, path = named.partition("=")
            drafts[name] = Path(path)
        engines = {name: Engine(target, path, n_threads=args.threads) for name, path in drafts.items()}
        if args.conv_ops:
            drafts["conv ops"] = shipped
            os.environ["IKDFLASH_DFLASH2_CONV_OPS"] = "1"  # read when the draft loads
            engines["conv ops"] = Engine(target, shipped, n_threads=args.threads)
            del os.environ["IKDFLASH_DFLASH2_CONV_OPS"]
        prompts = chat_prompts(engines["shipped"], QUESTIONS)
        ms: dict[tuple[str, int], list[float]] = {}
        accepted: dict[tuple[str, int], list[int]] = {}
        for _ in range(args.repeats):
            for n_max in (1, 2, 3, 4):
                for name, engine in engines.items():
                    steps = draft = 0.0
                    for prompt in prompts:
                        stats = engine.speculate(prompt, max_tokens=args.tokens, n_max=n_max, adaptive=False).stats
                        steps += stats.steps
                        draft += stats.draft_time
                        accepted.setdefault((name, n_max), []).append(stats.accepted)
                        accepted.setdefault((name, -n_max), []).append(stats.drafted)
                    ms.setdefault((name, n_max), []).append(1e3 * draft / steps)
        for engine in engines.values():
            engine.close()

    rows = []
    print("draft ms per step (median of repeats), acceptance; proposing n tokens a step")
    print(f"{'draft':>12} " + " ".join(f"{'n=' + str(n):>16}" for n in (1, 2, 3, 4)))
    for name in drafts:
        cells = []
        for n in (1, 2, 3, 4):
            t = statistics.median(ms[(name, n)])
            a = sum(accepted[(name, n)]) / max(1, sum(accepted[(name, -n)]))
            cells.append(f"{t:6.2f} ms {a:6.1%}")
            rows.append({"draft": name, "n": n, "draft_ms": round(t, 3), "acceptance": round(a, 4),
                         "vs_shipped": round(t / statistics.median(ms[("shipped", n)]), 3)})
        print(f"{name:>12} " + " ".join(f"{c:>16}" for c in cells))
    if args.json:
        write_result(args.json, {"tokens": args.tokens, "repeats": args.repeats, "rows": rows}, args.threads)
    return 0
