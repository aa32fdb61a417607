"""Tiny DFlash draft checkpoints, Hugging Face style, for tests and benchmarks.

    target = write_tiny_model(dir / "target.gguf", arch="qwen3")
    hf_target = write_hf_target(dir / "target-hf", target)       # config, tokenizer, embed + head
    draft = write_tiny_draft(dir / "draft", hf_target, target_layer_ids=[0, 2],
                             layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    gguf = ikdflash.convert.convert(draft, hf_target, outtype="f32")

The draft checkpoint is what the DFlash reference (`dflash` 0.1.0, DFlashDraftModel) loads with
from_pretrained; the HF target folder carries the target GGUF's own embedding and head, so the
reference and the fork compute with the same weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import gguf
import numpy as np

from ikdflash.hf import write_tensors
from ikdflash.pair import gguf_field


# GGUF -> Hugging Face names of a qwen3 decoder layer (the same matrices: no permutation for
# NeoX-style RoPE).
_QWEN3_LAYER = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def write_hf_target(folder: Path, target_gguf: Path, *, full: bool = False) -> Path:
    """A Hugging Face view of a GGUF target: config.json, tokenizer.json and the embedding/head;
    with full=True (qwen3 targets) every weight, loadable as transformers' Qwen3ForCausalLM."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(target_gguf)
    arch = gguf_field(reader, "general.architecture")
    weights = {t.name: np.array(t.data, dtype=np.float32) for t in reader.tensors
               if full or t.name in ("token_embd.weight", "output.weight")}
    embed = weights["token_embd.weight"]
    head = weights.get("output.weight", embed)
    tokens: list[str] = gguf_field(reader, "tokenizer.ggml.tokens")
    types: list[int] = gguf_field(reader, "tokenizer.ggml.token_type")
    merges: list[str] = gguf_field(reader, "tokenizer.ggml.merges")
    control = {i for i, t in enumerate(types) if t == gguf.TokenType.CONTROL}
    tokenizer = {
        "version": "1.0",
        "added_tokens": [{"id": i, "content": tokens[i], "special": True} for i in sorted(control)],
        "model": {"type": "BPE", "vocab": {t: i for i, t in enumerate(tokens) if i not in control},
                  "merges": merges},
    }
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    tok_config: dict[str, Any] = {}
    for role in ("bos", "eos"):
        key = f"tokenizer.ggml.{role}_token_id"
        if key in reader.fields:
            tok_config[f"{role}_token"] = tokens[int(gguf_field(reader, key))]
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    config = {
        "architectures": ["TinyTarget"],
        "model_type": arch,
        "hidden_size": int(gguf_field(reader, f"{arch}.embedding_length")),
        "num_hidden_layers": int(gguf_field(reader, f"{arch}.block_count")),
        "vocab_size": len(tokens),
    }
    tensors = {"model.embed_tokens.weight": embed, "lm_head.weight": head}
    if full:
        if arch != "qwen3":
            raise ValueError(f"full Hugging Face export is written for qwen3 targets, not {arch}")
        config |= {
            "architectures": ["Qwen3ForCausalLM"],
            "num_attention_heads": int(gguf_field(reader, f"{arch}.attention.head_count")),
            "num_key_value_heads": int(gguf_field(reader, f"{arch}.attention.head_count_kv")),
            "head_dim": int(gguf_field(reader, f"{arch}.attention.key_length")),
            "intermediate_size": int(gguf_field(reader, f"{arch}.feed_forward_length")),
            "rms_norm_eps": float(gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
            "rope_theta": float(gguf_field(reader, f"{arch}.rope.freq_base")),
            "max_position_embeddings": int(gguf_field(reader, f"{arch}.context_length")),
            "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
        }
        tensors["model.norm.weight"] = weights["output_norm.weight"]
        for name, array in weights.items():
            parts = name.split(".")
            if parts[0] == "blk":
                tensors[f"model.layers.{parts[1]}.{_QWEN3_LAYER[parts[2]]}.weight"] = array
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    write_tensors(folder / "model.safetensors", tensors)
    return folder


def write_tiny_draft(folder: Path, hf_target: Path, *, target_layer_ids: Sequence[int],
                     layer_types: Sequence[str] = ("full_attention", "full_attention"),
                     sliding_window: int | None = None, block_size: int = 8, mask_token_id: int | None = None,
                     n_head: int = 4, n_head_kv: int = 2, head_dim: int = 16, n_ff: int = 128,
                     rope_theta: float = 10000.0, rope_in_parameters: bool = False,
                     extra_config: dict[str, Any] | None = None, seed: int = 0,
                     dflash2: Mapping[str, int] | None = None) -> Path:
    """A random DFlashDraftModel checkpoint for the target in hf_target (hidden size taken from it).

    dflash2 (conv_kernel_size, conv_group_size, selector_rank, selector_top_k) makes it a
    DFlash2DraftModel: each layer's two in-block convolutions and the candidate selector."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    target_config = json.loads((Path(hf_target) / "config.json").read_text())
    hidden = target_config["hidden_size"]
    vocab = target_config["vocab_size"]
    n_layer = len(layer_types)
    if mask_token_id is None:
        tokenizer = json.loads((Path(hf_target) / "tokenizer.json").read_text())
        specials = [t for t in tokenizer["added_tokens"] if "mask" in t["content"]]
        mask_token_id = specials[0]["id"] if specials else vocab - 1
    config: dict[str, Any] = {
        "architectures": ["DFlash2DraftModel" if dflash2 else "DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": n_layer,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_head_kv,
        "head_dim": head_dim,
        "intermediate_size": n_ff,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "vocab_size": vocab,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "layer_types": list(layer_types),
        "use_sliding_window": sliding_window is not None,
        "sliding_window": sliding_window,
        "max_window_layers": n_layer,
        "num_target_layers": target_config["num_hidden_layers"],
        "block_size": block_size,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)},
    }
    if dflash2:
        config["dflash_config"] |= dict(dflash2)
    if rope_in_parameters:
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": rope_theta}
    else:
        config["rope_theta"] = rope_theta
    config.update(extra_config or {})
    (folder / "config.json").write_text(json.dumps(config, indent=2))

    rng = np.random.default_rng(seed)
    matrix = lambda rows, cols: rng.normal(0.0, 1.0 / np.sqrt(cols), (rows, cols)).astype(np.float32)  # noqa: E731
    norm = lambda n: (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)  # noqa: E731
    tensors = {
        "fc.weight": matrix(hidden, hidden * len(target_layer_ids)),
        "hidden_norm.weight": norm(hidden),
        "norm.weight": norm(hidden),
    }
    for il in range(n_layer):
        p = f"layers.{il}."
        tensors |= {
            p + "input_layernorm.weight": norm(hidden),
            p + "post_attention_layernorm.weight": norm(hidden),
            p + "self_attn.q_proj.weight": matrix(n_head * head_dim, hidden),
            p + "self_attn.k_proj.weight": matrix(n_head_kv * head_dim, hidden),
            p + "self_attn.v_proj.weight": matrix(n_head_kv * head_dim, hidden),
            p + "self_attn.o_proj.weight": matrix(hidden, n_head * head_dim),
            p + "self_attn.q_norm.weight": norm(head_dim),
            p + "self_attn.k_norm.weight": norm(head_dim),
            p + "mlp.gate_proj.weight": matrix(n_ff, hidden),
            p + "mlp.up_proj.weight": matrix(n_ff, hidden),
            p + "mlp.down_proj.weight": matrix(hidden, n_ff),
        }
    if dflash2:
        tensors |= _dflash2_tensors(rng, dict(dflash2), n_layer, hidden, vocab)
    write_tensors(folder / "model.safetensors", tensors)
    return folder


def _dflash2_tensors(rng: np.random.Generator, settings: dict[str, int], n_layer: int, hidden: int,
                     vocab: int) -> dict[str, np.ndarray]:
    """Random DFlash2 weights under the names the reference's checkpoints use. Each convolution's
    base kernel starts near the identity (tap 0 near 1), so activations keep their scale."""
    taps, groups = settings["conv_kernel_size"], hidden // settings["conv_group_size"]
    rank = settings["selector_rank"]
    tensors = {}
    for il in range(n_layer):
        for conv in ("attention_conv", "mlp_conv"):
            base = 0.3 * rng.standard_normal((2, taps, hidden))
            base[:, 0] += 1.0
            p = f"layers.{il}.{conv}."
            tensors[p + "base_kernel"] = base.astype(np.float32)
            tensors[p + "kernel_projection.weight"] = (
                0.3 / np.sqrt(hidden) * rng.standard_normal((2 * taps * groups, hidden))).astype(np.float32)
    tensors |= {
        "candidate_selector.predecessor_codebook": rng.standard_normal((vocab, rank)).astype(np.float32),
        "candidate_selector.successor_codebook": rng.standard_normal((vocab, rank)).astype(np.float32),
        "candidate_selector.hidden_projection.weight":
            (1.0 / np.sqrt(hidden) * rng.standard_normal((rank, hidden))).astype(np.float32),
    }
    return tensors
