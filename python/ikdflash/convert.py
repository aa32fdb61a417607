"""Convert a Hugging Face DFlash draft into ik_llama.cpp's `dflash-draft` GGUF.

    ikdflash convert DRAFT_DIR --target-model-dir TARGET [--outtype f32|f16|bf16|q8_0] [--outfile PATH]
    python -m ikdflash.convert ...

DRAFT_DIR holds config.json (architecture DFlashDraftModel) and safetensors weights. TARGET is
the target's Hugging Face folder (config.json + tokenizer.json) or its GGUF file: the draft reads
the target's tokenizer, hidden size and layer count from it.

The file is what ik_llama.cpp itself writes (see docs: the format), with two corrections and
four additions:
  * the RoPE base is read wherever the config keeps it (top-level rope_theta or
    rope_parameters.rope_theta; ik's converter silently falls back to 10000 for the latter);
  * sliding layers come from layer_types exactly (ik marks every layer sliding without it);
  * settings the reference honours but ik's format drops go into optional keys, absent when the
    config does not state them, so files without them load with the reference defaults:
    {arch}.dflash.is_causal, .input_embedding_scale, .output_multiplier,
    .final_logit_softcapping.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np
import gguf

from ikdflash.hf import CheckpointError, read_config, read_tensors, text_config
from ikdflash.pair import gguf_field

ARCH = "dflash-draft"
OUTTYPES = {
    "f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}
MAX_TARGET_LAYERS = 8  # what ik_llama.cpp's loader accepts

# Hugging Face name (after dropping a leading "model.") -> GGUF name, per layer and global.
LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GLOBAL_TENSORS = {
    "fc.weight": "dflash_fc.weight",
    "hidden_norm.weight": "dflash_hidden_norm.weight",
    "norm.weight": "output_norm.weight",
}
OPTIONAL_TENSORS = {"embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight"}


class ConversionError(ValueError):
    """The checkpoint cannot be expressed as a dflash-draft GGUF; the message says why."""


@dataclass
class DraftHeader:
    """Every value the GGUF header carries, resolved from the draft's config."""

    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    rms_eps: float
    context_length: int
    rope_theta: float
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    n_target_features: int
    sliding_window: int = 0
    sliding_pattern: list[bool] = field(default_factory=list)
    # Reference-only settings; None = not stated in the config (reference default applies).
    is_causal: bool | None = None
    input_embedding_scale: float | None = None
    output_multiplier: float | None = None
    final_logit_softcapping: float | None = None


@dataclass
class TargetInfo:
    hidden_size: int
    n_layer: int
    n_vocab: int
    tokenizer: dict[str, Any]  # GGUF tokenizer.* key -> value


# --- reading the draft config ------------------------------------------------------------------

def _draft_value(config: Mapping[str, Any], name: str, default: Any = None) -> Any:
    """The reference's lookup: dflash_config first, then the top level."""
    return config.get("dflash_config", {}).get(name, config.get(name, default))


def _require(config: Mapping[str, Any], name: str, where: str) -> Any:
    if name not in config:
        raise ConversionError(f"{where}: missing required key '{name}'")
    return config[name]


def _rope_theta(config: Mapping[str, Any], where: str) -> float:
    if "rope_theta" in config:
        return float(config["rope_theta"])
    params = config.get("rope_parameters") or {}
    if "rope_theta" in params:
        return float(params["rope_theta"])
    return 10000.0  # transformers' Qwen3 default when neither is given


def _check_rope_scaling(config: Mapping[str, Any], where: str) -> None:
    for key in ("rope_scaling", "rope_parameters"):
        params = config.get(key) or {}
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in ("default", None):
            raise ConversionError(f"{where}: {key} type '{kind}' is not supported (only plain RoPE)")
    factor = float(config.get("partial_rotary_factor", 1.0))
    if factor != 1.0:
        raise ConversionError(f"{where}: partial_rotary_factor={factor} is not supported")


def read_draft_header(config: Mapping[str, Any], target: TargetInfo, where: str) -> DraftHeader:
    archs = config.get("architectures") or []
    if "DFlashDraftModel" not in archs:
        raise ConversionError(f"{where}: architecture {archs or 'unknown'} is not supported "
                              "(expected DFlashDraftModel)")
    if config.get("attention_bias"):
        raise ConversionError(f"{where}: attention_bias=true is not supported by the dflash-draft format")
    if config.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"{where}: hidden_act '{config['hidden_act']}' is not supported (only silu)")
    _check_rope_scaling(config, where)

    n_layer = int(_require(config, "num_hidden_layers", where))
    n_embd = int(_require(config, "hidden_size", where))
    n_head = int(_require(config, "num_attention_heads", where))
    layer_ids = _draft_value(config, "target_layer_ids")
    if layer_ids is None:
        raise ConversionError(f"{where}: missing required key 'target_layer_ids' (in dflash_config or top level)")
    layer_ids = [int(i) for i in layer_ids]
    if not 1 <= len(layer_ids) <= MAX_TARGET_LAYERS or len(set(layer_ids)) != len(layer_ids):
        raise ConversionError(f"{where}: target_layer_ids {layer_ids} must be 1..{MAX_TARGET_LAYERS} distinct ids")
    bad = [i for i in layer_ids if not 0 <= i < target.n_layer]
    if bad:
        raise ConversionError(f"{where}: target_layer_ids {bad} are outside the target's {target.n_layer} layers")
    mask_token_id = _draft_value(config, "mask_token_id")
    if mask_token_id is None:
        raise ConversionError(f"{where}: missing required key 'mask_token_id'")
    if not 0 <= int(mask_token_id) < target.n_vocab:
        raise ConversionError(f"{where}: mask_token_id {mask_token_id} is outside the target vocabulary "
                              f"({target.n_vocab} tokens)")
    block_size = int(_draft_value(config, "block_size", 16))
    if block_size < 2:
        raise ConversionError(f"{where}: block_size must be at least 2, got {block_size}")

    layer_types = config.get("layer_types") or ["full_attention"] * n_layer
    if len(layer_types) != n_layer:
        raise ConversionError(f"{where}: layer_types has {len(layer_types)} entries for {n_layer} layers")
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ConversionError(f"{where}: unsupported layer_types {unknown}")
    pattern = [t == "sliding_attention" for t in layer_types]
    window = int(config.get("sliding_window") or 0) if any(pattern) else 0
    if any(pattern) and window < 1:
        raise ConversionError(f"{where}: layer_types has sliding layers but sliding_window is not set")

    def optional_float(name: str) -> float | None:
        value = _draft_value(config, name)
        return None if value is None else float(value)

    return DraftHeader(
        n_layer=n_layer, n_embd=n_embd, n_head=n_head,
        n_head_kv=int(config.get("num_key_value_heads", n_head)),
        head_dim=int(config.get("head_dim") or n_embd // n_head),
        n_ff=int(_require(config, "intermediate_size", where)),
        rms_eps=float(config.get("rms_norm_eps", 1e-6)),
        context_length=int(config.get("max_position_embeddings", 32768)),
        rope_theta=_rope_theta(config, where),
        block_size=block_size, mask_token_id=int(mask_token_id), target_layer_ids=layer_ids,
        n_target_features=target.hidden_size * len(layer_ids),
        sliding_window=window, sliding_pattern=pattern if window else [],
        is_causal=None if config.get("is_causal") is None else bool(config["is_causal"]),
        input_embedding_scale=optional_float("input_embedding_scale"),
        output_multiplier=optional_float("output_multiplier"),
        final_logit_softcapping=optional_float("final_logit_softcapping"),
    )


# --- reading the target ------------------------------------------------------------------------

def _bpe_tokenizer_from_hf(folder: Path) -> dict[str, Any]:
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ConversionError(f"{path}: not found; the draft takes its tokenizer from the target")
    tok = json.loads(path.read_text())
    model = tok.get("model", {})
    if model.get("type") != "BPE":
        raise ConversionError(f"{path}: tokenizer type {model.get('type')} is not supported (only byte-level BPE)")
    vocab: dict[str, int] = dict(model["vocab"])
    special = set()
    for added in tok.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        if added.get("special"):
            special.add(added["id"])
    n_vocab = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [gguf.TokenType.UNUSED] * n_vocab
    for text, idx in vocab.items():
        tokens[idx] = text
        types[idx] = gguf.TokenType.CONTROL if idx in special else gguf.TokenType.NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    result: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [int(t) for t in types],
        "tokenizer.ggml.merges": merges,
    }
    tok_config_path = folder / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text()) if tok_config_path.is_file() else {}
    for role in ("bos", "eos", "pad"):
        name = tok_config.get(f"{role}_token")
        if isinstance(name, dict):
            name = name.get("content")
        if name in vocab:
            result[f"tokenizer.ggml.{role}_token_id"] = vocab[name]
    if "add_bos_token" in tok_config:
        result["tokenizer.ggml.add_bos_token"] = bool(tok_config["add_bos_token"])
    return result


def read_target(target: Path) -> TargetInfo:
    if not target.exists():
        raise ConversionError(f"target {target} does not exist (give the target's HF folder or GGUF file)")
    if target.is_file():
        try:
            reader = gguf.GGUFReader(target)
        except (ValueError, OSError) as e:
            raise ConversionError(f"{target}: not a readable GGUF file: {e}") from None
        arch = gguf_field(reader, "general.architecture")
        tokenizer = {k: gguf_field(reader, k) for k in reader.fields if k.startswith("tokenizer.")}
        if "tokenizer.ggml.tokens" not in tokenizer:
            raise ConversionError(f"{target}: the GGUF has no tokenizer")
        return TargetInfo(hidden_size=int(gguf_field(reader, f"{arch}.embedding_length")),
                          n_layer=int(gguf_field(reader, f"{arch}.block_count")),
                          n_vocab=len(tokenizer["tokenizer.ggml.tokens"]), tokenizer=tokenizer)
    try:
        config = text_config(read_config(target))
    except CheckpointError as e:
        raise ConversionError(str(e)) from None
    tokenizer = _bpe_tokenizer_from_hf(target)
    hidden = config.get("hidden_size")
    if hidden is None:
        raise ConversionError(f"{target}/config.json: no hidden_size (needed for the draft's feature width)")
    return TargetInfo(hidden_size=int(hidden), n_layer=int(config.get("num_hidden_layers", 0)),
                      n_vocab=int(config.get("vocab_size", len(tokenizer["tokenizer.ggml.tokens"]))),
                      tokenizer=tokenizer)


# --- tensors -----------------------------------------------------------------------------------

def map_tensors(weights: Mapping[str, np.ndarray], header: DraftHeader, where: str) -> dict[str, np.ndarray]:
    """HF names -> GGUF names, checking that every expected weight is there and nothing else."""
    out: dict[str, np.ndarray] = {}
    unknown = []
    for hf_name, array in weights.items():
        name = hf_name.removeprefix("model.")
        layer = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
        if layer and layer.group(2) in LAYER_TENSORS and int(layer.group(1)) < header.n_layer:
            out[f"blk.{layer.group(1)}.{LAYER_TENSORS[layer.group(2)]}"] = array
        elif name in GLOBAL_TENSORS:
            out[GLOBAL_TENSORS[name]] = array
        elif name in OPTIONAL_TENSORS:
            out[OPTIONAL_TENSORS[name]] = array
        else:
            unknown.append(hf_name)
    if unknown:
        raise ConversionError(f"{where}: weights the dflash-draft format cannot hold: {', '.join(sorted(unknown))}")
    expected = list(GLOBAL_TENSORS.values()) + [f"blk.{i}.{t}" for i in range(header.n_layer)
                                                 for t in LAYER_TENSORS.values()]
    missing = [n for n in expected if n not in out]
    if missing:
        raise ConversionError(f"{where}: missing weights: {', '.join(missing)}")
    if "output.weight" in out and "token_embd.weight" not in out:
        raise ConversionError(f"{where}: lm_head without embed_tokens is not a valid dflash-draft layout")
    fc = out["dflash_fc.weight"]
    if fc.shape != (header.n_embd, header.n_target_features):
        raise ConversionError(f"{where}: fc.weight has shape {list(fc.shape)}, expected "
                              f"[{header.n_embd}, {header.n_target_features}] (hidden_size x target hidden "
                              f"size {header.n_target_features // len(header.target_layer_ids)} x "
                              f"{len(header.target_layer_ids)} target layers)")
    return out


def encode_tensor(array: np.ndarray, outtype: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """1-D tensors (norms) stay F32, as ik's converter keeps them; matrices take the outtype."""
    qtype = OUTTYPES[outtype][0]
    if array.ndim <= 1 or qtype == gguf.GGMLQuantizationType.F32:
        return array.astype(np.float32), gguf.GGMLQuantizationType.F32
    if qtype == gguf.GGMLQuantizationType.F16:
        return array.astype(np.float16), qtype
    if qtype == gguf.GGMLQuantizationType.Q8_0 and array.shape[-1] % 32 != 0:
        return array.astype(np.float16), gguf.GGMLQuantizationType.F16  # Q8_0 needs rows of 32
    return gguf.quants.quantize(array.astype(np.float32), qtype), qtype


# --- writing -----------------------------------------------------------------------------------

def write_header(writer: gguf.GGUFWriter, header: DraftHeader, outtype: str) -> None:
    a = ARCH
    writer.add_uint32(f"{a}.block_count", header.n_layer)
    writer.add_uint32(f"{a}.context_length", header.context_length)
    writer.add_uint32(f"{a}.embedding_length", header.n_embd)
    writer.add_uint32(f"{a}.feed_forward_length", header.n_ff)
    writer.add_uint32(f"{a}.attention.head_count", header.n_head)
    writer.add_uint32(f"{a}.attention.head_count_kv", header.n_head_kv)
    writer.add_uint32(f"{a}.attention.key_length", header.head_dim)
    writer.add_uint32(f"{a}.attention.value_length", header.head_dim)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", header.rms_eps)
    writer.add_float32(f"{a}.rope.freq_base", header.rope_theta)
    writer.add_uint32(f"{a}.rope.dimension_count", header.head_dim)
    writer.add_bool(f"{a}.attention.causal", False)  # as ik writes it; see dflash.is_causal
    writer.add_uint32("general.file_type", int(OUTTYPES[outtype][1]))
    writer.add_uint32(f"{a}.dflash.block_size", header.block_size)
    writer.add_uint32(f"{a}.dflash.mask_token_id", header.mask_token_id)
    writer.add_array(f"{a}.dflash.target_layer_ids", header.target_layer_ids)
    writer.add_uint32(f"{a}.dflash.n_target_features", header.n_target_features)
    if header.sliding_window:
        writer.add_uint32(f"{a}.attention.sliding_window", header.sliding_window)
        writer.add_array(f"{a}.attention.sliding_window_pattern", header.sliding_pattern)
    if header.is_causal is not None:
        writer.add_bool(f"{a}.dflash.is_causal", header.is_causal)
    for name in ("input_embedding_scale", "output_multiplier", "final_logit_softcapping"):
        value = getattr(header, name)
        if value is not None:
            writer.add_float32(f"{a}.dflash.{name}", value)


def add_tokenizer_fields(writer: gguf.GGUFWriter, tokenizer: Mapping[str, Any]) -> None:
    for key, value in tokenizer.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif key == "tokenizer.ggml.token_type":
            writer.add_array(key, [int(v) for v in value])
        else:
            writer.add_array(key, list(value))


def convert(draft_dir: Path, target: Path, *, outtype: str = "f16", outfile: Path | None = None,
            log=lambda msg: print(msg, file=sys.stderr)) -> Path:
    """Convert; returns the path written. Raises ConversionError with the reason."""
    draft_dir, target = Path(draft_dir), Path(target)
    if outtype not in OUTTYPES:
        raise ConversionError(f"unknown outtype '{outtype}' (choose from {', '.join(OUTTYPES)})")
    if not draft_dir.is_dir():
        raise ConversionError(f"draft folder {draft_dir} does not exist")
    try:
        config = read_config(draft_dir)
        target_info = read_target(target)
        header = read_draft_header(config, target_info, f"{draft_dir}/config.json")
        tensors = map_tensors(read_tensors(draft_dir), header, str(draft_dir))
    except CheckpointError as e:
        raise ConversionError(str(e)) from None
    outfile = Path(outfile) if outfile else draft_dir / f"{draft_dir.name}-{outtype.upper()}.gguf"

    writer = gguf.GGUFWriter(str(outfile), ARCH)
    writer.add_string("general.name", draft_dir.name)
    write_header(writer, header, outtype)
    add_tokenizer_fields(writer, target_info.tokenizer)
    writer.add_uint32("general.quantization_version", gguf.GGML_QUANT_VERSION)
    for i, (name, array) in enumerate(tensors.items(), 1):
        data, qtype = encode_tensor(array, outtype)
        writer.add_tensor(name, data, raw_dtype=qtype)
        log(f"[{i}/{len(tensors)}] {name:36s} {str(list(array.shape)):16s} {qtype.name}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    sliding = sum(header.sliding_pattern)
    log(f"wrote {outfile}: {header.n_layer} layers ({sliding} sliding, window {header.sliding_window}), "
        f"block {header.block_size}, target layers {header.target_layer_ids}")
    return outfile


# --- command line ------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("draft_dir", type=Path, help="Hugging Face DFlash draft folder")
    parser.add_argument("--target-model-dir", type=Path, required=True,
                        help="the target's Hugging Face folder or GGUF file (tokenizer, hidden size)")
    parser.add_argument("--outtype", choices=sorted(OUTTYPES), default="f16",
                        help="type of the weight matrices; norms stay F32 (default: f16)")
    parser.add_argument("--outfile", type=Path, help="output path (default: DRAFT_DIR/<name>-<TYPE>.gguf)")


def run(args: argparse.Namespace) -> int:
    try:
        convert(args.draft_dir, args.target_model_dir, outtype=args.outtype, outfile=args.outfile)
    except ConversionError as e:
        print(f"ikdflash convert: error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ikdflash.convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
