"""How close the speculative loop runs to its bound, in _core and in llama-server.

    python -m benchmarks.server overhead [--tokens 256] [--repeats 5] [--gpu-layers 99] [--json out.json]

The always-right pair: a tiny target whose head is all zeros (greedy picks token 0 forever)
and a draft that borrows that head, so every draft is accepted and each step yields
tau = n_max + 1 tokens. A step cannot cost less than one draft pass plus one target pass over
the block, so the bound is tau / (t_draft + t_verify) tokens/s, with both times measured by the
engine in the same run. The script reports, for the engine (_core) and for llama-server:

    tokens/s     generated tokens over the decoding time (prompt excluded)
    ratio        tokens/s over the bound (the issue asks >= 0.95)
    elsewhere    the share of decoding time outside draft and target passes: sampling, KV
                 bookkeeping, the Python callback (engine), slots, HTTP and JSON (server)

The server's decoding time is its own `predicted_ms`; the client's wall time (HTTP included)
is shown beside it. The server also reports its own pass times (`draft_ms`, `verify_ms` in a
reply's timings), which give its own bound: that tells passes that cost more in the server from
time its loop spends elsewhere. Engine and server run interleaved, medians of the repeats.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from ikdflash import Engine, Server
from ikdflash.serving.client import post_json
from ikdflash.convert import convert
from ikdflash.serving.spectype import SpecType
from tests.fixtures.tinydraft import write_hf_target, write_tiny_draft
from tests.fixtures.tinymodels import write_tiny_model
from benchmarks.harness import write_result

N_MAX = 4


def always_right_pair(folder: Path) -> tuple[Path, Path]:
    target = write_tiny_model(folder / "target.gguf", arch="llama", n_embd=256, n_layer=8, n_head=8, n_head_kv=4,
                              head_dim=32, n_ff=1024, zero_head=True, n_ctx_train=4096)
    hf = write_hf_target(folder / "hf", target)
    checkpoint = write_tiny_draft(folder / "draft", hf, target_layer_ids=[1, 4, 6], block_size=8,
                                  layer_types=["sliding_attention", "full_attention"], sliding_window=64)
    return target, convert(checkpoint, hf, outtype="f16", log=lambda _: None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gpu-layers", type=int, default=0, help="target layers on the GPU (the draft follows)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    prompt = [(i * 7919) % 250 for i in range(64)]
    runs: dict[str, list[float]] = {k: [] for k in (
        "tau", "draft_ms", "verify_ms", "engine_tps", "engine_elsewhere", "server_tps", "server_client_tps",
        "server_tau", "server_draft_ms", "server_verify_ms")}
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = always_right_pair(Path(tmp))
        engine = Engine(target, draft, n_ctx=1024, n_threads=args.threads, n_gpu_layers=args.gpu_layers)
        body = {"prompt": prompt, "n_predict": args.tokens, "temperature": 0, "ignore_eos": True,
                "cache_prompt": False}
        with Server(target, ctx_size=1024, n_threads=args.threads, log_file=Path(tmp) / "server.log",
                    extra_args=["--model-draft", str(draft), "--spec-type", SpecType(n_max=N_MAX, adaptive=False).flag(),
                                "-ngl", str(args.gpu_layers)]) as url:
            post_json(url + "/completion", body)  # warm-up
            engine.speculate(prompt, max_tokens=args.tokens, n_max=N_MAX, adaptive=False)
            for _ in range(args.repeats):
                start = time.perf_counter()
                st = engine.speculate(prompt, max_tokens=args.tokens, n_max=N_MAX, adaptive=False).stats
                decoding = time.perf_counter() - start - st.prompt_time
                runs["tau"].append(st.generated / st.steps)
                runs["draft_ms"].append(st.draft_time / st.steps * 1e3)
                runs["verify_ms"].append(st.verify_time / st.steps * 1e3)
                runs["engine_tps"].append(st.generated / decoding)
                runs["engine_elsewhere"].append(1 - (st.draft_time + st.verify_time) / decoding)
                start = time.perf_counter()
                reply = post_json(url + "/completion", body)
                wall = time.perf_counter() - start - reply["timings"]["prompt_ms"] / 1e3
                runs["server_tps"].append(reply["timings"]["predicted_n"] / reply["timings"]["predicted_ms"] * 1e3)
                runs["server_client_tps"].append(reply["timings"]["predicted_n"] / wall)
                steps = reply["timings"]["draft_steps"]
                runs["server_tau"].append(reply["timings"]["predicted_n"] / steps)
                runs["server_draft_ms"].append(reply["timings"]["draft_ms"] / steps)
                runs["server_verify_ms"].append(reply["timings"]["verify_ms"] / steps)
        engine.close()
    row = {k: statistics.median(v) for k, v in runs.items()}
    bound = row["tau"] / (row["draft_ms"] + row["verify_ms"]) * 1e3
    # at the same pass times per step, the share of a token's time spent outside the passes
    row |= {"bound_tps": bound, "engine_ratio": row["engine_tps"] / bound, "server_ratio": row["server_tps"] / bound,
            "server_client_ratio": row["server_client_tps"] / bound, "server_elsewhere": 1 - row["server_tps"] / bound}
    own_bound = row["server_tau"] / (row["server_draft_ms"] + row["server_verify_ms"]) * 1e3
    row |= {"server_own_bound_tps": own_bound, "server_own_ratio": row["server_tps"] / own_bound}
    print(f"tau {row['tau']:.2f}; a step: draft {row['draft_ms']:.2f} ms + verify {row['verify_ms']:.2f} ms; "
          f"bound {bound:.0f} tok/s")
    print(f"engine (_core): {row['engine_tps']:.0f} tok/s = {row['engine_ratio']:.3f} of the bound; "
          f"{100 * row['engine_elsewhere']:.1f}% of decoding outside the two passes")
    print(f"llama-server:   {row['server_tps']:.0f} tok/s = {row['server_ratio']:.3f} of the bound "
          f"({100 * row['server_elsewhere']:.1f}% outside the passes; client side, HTTP included: "
          f"{row['server_client_tps']:.0f} tok/s = {row['server_client_ratio']:.3f})")
    print(f"llama-server's own passes: tau {row['server_tau']:.2f}; draft {row['server_draft_ms']:.2f} ms + "
          f"verify {row['server_verify_ms']:.2f} ms; its own bound {own_bound:.0f} tok/s, reached at "
          f"{row['server_own_ratio']:.3f}")
    if args.json:
        write_result(args.json, row, args.threads)
