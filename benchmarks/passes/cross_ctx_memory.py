"""Cross-context memory of the Qwen3.5-35B-A3B SWA draft's shape, read from the actual allocation.

    python -m benchmarks.passes cross-ctx-memory [--cross-ctx 8192 65536] [--json out.json]

The cross-context holds, per draft layer, the keys and values of context rows: its size depends
on the layer count, kv heads x head dim, the window and the sliding pattern only. This script
builds a draft with exactly that draft's values for those (Qwen3.5-35B-A3B-DFlash SWA: 6 layers,
8 kv heads of 128, window 4096, 5 sliding + 1 full) on a tiny target, allocates the cross-context
for each cross_ctx, with the window honoured and with every layer full (how ik_llama.cpp sizes
it), and reports the bytes the fork allocated.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from ikdflash import _core
from ikdflash.convert import convert
from tests.fixtures.tinydraft import write_hf_target, write_tiny_draft
from tests.fixtures.tinymodels import write_tiny_model
from benchmarks.harness import write_result

QWEN35_SWA_SHAPE = dict(layer_types=["sliding_attention"] * 5 + ["full_attention"], sliding_window=4096,
                  n_head=8, n_head_kv=8, head_dim=128, n_ff=64, block_size=16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cross-ctx", type=int, nargs="+", default=[8192, 65536])
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        target = write_tiny_model(tmp / "target.gguf", arch="qwen3")
        hf = write_hf_target(tmp / "hf", target)
        checkpoint = write_tiny_draft(tmp / "draft", hf, target_layer_ids=[0, 2], **QWEN35_SWA_SHAPE)
        draft_path = convert(checkpoint, hf, outtype="f16", log=lambda _: None)
        model = _core.Model(str(target), n_ctx=256)
        draft = _core.Draft(model, str(draft_path))
        rows = []
        for cross_ctx in args.cross_ctx:
            swa = draft.cache_layout(cross_ctx)
            full = draft.cache_layout(cross_ctx, full_attention=True)
            rows.append({"cross_ctx": cross_ctx, "swa_bytes": swa["bytes"], "swa_capacity": swa["capacity"],
                         "all_full_bytes": full["bytes"], "all_full_capacity": full["capacity"]})
    print(f"{'cross_ctx':>9} | {'window honoured':>16} | {'all layers full':>16} | ratio")
    for r in rows:
        print(f"{r['cross_ctx']:>9} | {r['swa_bytes'] / 2**20:>12.1f} MiB | {r['all_full_bytes'] / 2**20:>12.1f} MiB "
              f"| {r['all_full_bytes'] / r['swa_bytes']:.2f}x   rows per layer {r['swa_capacity']}")
    if args.json:
        write_result(args.json, rows, threads=1)
