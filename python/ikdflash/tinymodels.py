"""Tiny random-weight GGUF *target* models for tests.

    from ikdflash.tinymodels import write_tiny_model
    write_tiny_model("/tmp/t.gguf", arch="qwen35moe")          # defaults
    write_tiny_model("/tmp/t.gguf", arch="llama", n_layer=2)    # overrides

Four architectures, each written exactly as the ik_llama.cpp fork's loader wants it
(src/llama-hparams.cpp for keys, src/llama-load-tensors.cpp for tensors and shapes):

* ``llama``     - standard pre-norm transformer, SwiGLU FFN, "norm" RoPE.
* ``qwen3``     - as llama plus per-head RMS q_norm/k_norm, NeoX RoPE.
* ``qwen35moe`` - Qwen3.5 MoE hybrid: Gated DeltaNet (linear attention) layers with a
  full, output-gated attention layer every ``full_attention_interval``-th layer, and an
  MoE FFN (softmax router + sigmoid-gated shared expert) in every layer. RoPE is
  "imrope" (interleaved multi-section) and needs ``rope.dimension_sections``.
* ``mamba``     - Mamba (v1): attention-free, every layer a selective state-space block
  (in_proj to x|z, causal conv over x, selective scan, gated by silu(z)); no FFN, no RoPE.
  The base only supports an expansion factor of 2, so ``ssm.inner_size`` is ``2 * n_embd``.

All weights are F32 and drawn from a seeded numpy generator, so a spec always gives the
same file byte for byte. The scales keep activations O(1) through the stack and make the
output logits spread (std ~3), so greedy generation depends on context and does not
settle on one token.

Every model shares one small byte-level BPE vocabulary (see ``TOKENIZER``); the DFlash
draft converter copies it into drafts with ``add_tokenizer(writer)``.

GPU note: the fork's CUDA DeltaNet kernel only supports head sizes 64 and 128, hence the
``ssm_state_size`` default of 64. Attention ``head_dim`` 16 runs everywhere on the CPU;
use ``head_dim=64`` if a test wants CUDA flash attention for the attention layers too.
The fork has no CUDA kernel for Mamba's selective scan: that op stays on the CPU.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

ARCHS = ("llama", "qwen3", "qwen35moe", "mamba")


@dataclass(frozen=True)
class TinySpec:
    arch: str                      # "llama" | "qwen3" | "qwen35moe" | "mamba"
    n_layer: int = 4
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 16
    n_ff: int = 128                # dense FFN width (llama, qwen3)
    n_ctx_train: int = 4096
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    # --- qwen35moe only -------------------------------------------------------------
    # MoE FFN: routed experts plus one always-on shared expert.
    n_expert: int = 4
    n_expert_used: int = 2
    n_ff_exp: int = 32
    n_ff_shexp: int = 32
    # Layer i is full attention iff (i + 1) % interval == 0 (the loader's rule).
    full_attention_interval: int = 4
    # SSM sizes, named after their GGUF keys; inner_size is derived. Gated DeltaNet
    # (qwen35moe): state_size is the per-head key (and value) dim, group_count the number of
    # key heads, time_step_rank the number of value heads (a multiple of the key heads).
    # Mamba: state_size is the state per channel, time_step_rank the rank of the dt
    # projection; group_count is not used.
    ssm_conv_kernel: int = 4
    ssm_state_size: int = 64
    ssm_group_count: int = 2
    ssm_time_step_rank: int = 4
    # Rotary dims per head; 0 = all of head_dim. llama/qwen3 graphs require all of it.
    rope_dim: int = 0
    # GGML type of the projection matrices ("F32", or a block quant gguf-py writes, e.g.
    # "Q4_1"): the CPU kernels for quantized weights take other paths than F32's.
    weight_type: str = "F32"
    # An all-zero head: every logit ties, so greedy decoding picks token 0 forever, and a draft
    # borrowing this head always agrees (the always-right pair of tests and benchmarks).
    zero_head: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {ARCHS}, got {self.arch!r}")
        if self.n_head % self.n_head_kv:
            raise ValueError("n_head must be a multiple of n_head_kv")
        if self.weight_type not in gguf.GGMLQuantizationType.__members__:
            raise ValueError(f"weight_type: not a GGML type: {self.weight_type!r}")
        if self.rope_dim and (self.arch != "qwen35moe" or self.rope_dim % 2 or self.rope_dim > self.head_dim):
            raise ValueError("rope_dim: qwen35moe only, even and <= head_dim")
        if self.arch == "qwen35moe":
            if not 0 < self.n_expert_used <= self.n_expert:
                raise ValueError("need 0 < n_expert_used <= n_expert")
            if self.ssm_time_step_rank % self.ssm_group_count:
                raise ValueError("ssm_time_step_rank (value heads) must be a multiple of ssm_group_count (key heads)")

    @property
    def n_rot(self) -> int:
        return self.rope_dim or self.head_dim

    @property
    def ssm_inner_size(self) -> int:
        if self.arch == "mamba":
            return 2 * self.n_embd  # the only expansion factor build_mamba supports
        # The loader sizes tensors with head_v_dim = state_size, the graph with
        # head_v_dim = inner_size / time_step_rank; this keeps the two in agreement.
        return self.ssm_state_size * self.ssm_time_step_rank

    def is_recurrent(self, il: int) -> bool:
        """True for a state-space layer (every mamba layer, a qwen35moe DeltaNet layer), False
        for an attention layer."""
        if self.arch == "mamba":
            return True
        return self.arch == "qwen35moe" and (il + 1) % self.full_attention_interval != 0


# ----------------------------------------------------------------------------------------
# Tokenizer: byte-level BPE ("gpt2" model), ids 0..255 = the bytes, then merges, then specials.
# ----------------------------------------------------------------------------------------

def _byte_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table, indexed by byte value.

    Bytes that are already visible, non-space Latin-1 characters stand for themselves;
    the rest (controls, space, 0x7f-0xa0, 0xad) are moved in order to U+0100 upwards, so
    every byte is one visible character and a merge rule can use ' ' as its separator.
    """
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, shifted = [""] * 256, 0
    for b in range(256):
        if b in visible:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


BYTE_TO_UNICODE = _byte_to_unicode()

# Merge rules in rank order, written as plain text (a leading " " is the word's space).
# The order matters: a rule only fires if its pieces exist when it is the best-ranked pair,
# e.g. " t"+"h" must outrank "t"+"h" for " the" to become one token.
_MERGE_TEXT: tuple[tuple[str, str], ...] = (
    (" ", "t"), (" t", "h"), ("t", "h"), ("h", "e"), (" th", "e"), ("th", "e"),
    (" ", "a"), ("i", "n"), ("e", "r"), ("a", "n"), ("o", "n"), ("r", "e"), ("a", "t"),
    ("e", "n"), ("o", "r"), ("e", "s"), ("i", "s"), ("i", "t"), ("e", "d"), ("n", "d"),
    ("o", "u"), ("a", "r"), ("a", "l"), ("l", "e"), ("s", "t"), ("o", "m"), ("l", "l"),
    ("a", "s"), ("i", "c"), ("in", "g"),
    (" ", "s"), (" ", "o"), (" ", "w"), (" ", "c"), (" ", "b"), (" ", "f"), (" ", "m"),
    (" ", "p"), (" ", "d"), (" ", "h"), (" ", "l"), (" ", "n"), (" ", "e"), (" ", "r"),
    (" a", "nd"), (" a", "n"), (" a", "t"), (" a", "s"), (" o", "f"), (" t", "o"),
    (" ", "in"), (" ", "is"), (" ", "it"), (" ", "on"), (" ", "or"), (" ", "re"), (" ", "he"),
    (" c", "at"), (" s", "at"), (" m", "at"), (" w", "as"),
)
_SPECIALS = ("<|bos|>", "<|eos|>", "<|mask|>")


def _encode(text: str) -> str:
    return "".join(BYTE_TO_UNICODE[b] for b in text.encode("utf-8"))


@dataclass(frozen=True)
class TokenizerInfo:
    """What the shared tiny vocabulary is, for tests and the draft converter."""

    model: str            # tokenizer.ggml.model
    pre: str              # tokenizer.ggml.pre; "qwen2" has clean_spaces off -> exact round trip
    n_vocab: int
    n_merges: int
    bos_id: int
    eos_id: int
    mask_id: int          # spare control token DFlash uses as the block mask
    add_bos: bool


TOKENIZER = TokenizerInfo(
    model="gpt2", pre="qwen2",
    n_vocab=256 + len(_MERGE_TEXT) + len(_SPECIALS), n_merges=len(_MERGE_TEXT),
    bos_id=256 + len(_MERGE_TEXT), eos_id=256 + len(_MERGE_TEXT) + 1, mask_id=256 + len(_MERGE_TEXT) + 2,
    add_bos=False,
)


def vocab_tokens() -> list[str]:
    """The token strings by id: 256 byte tokens, one token per merge result, specials."""
    return [*BYTE_TO_UNICODE, *(_encode(a + b) for a, b in _MERGE_TEXT), *_SPECIALS]


def vocab_merges() -> list[str]:
    """The merge rules as GGUF stores them: "left right" in the byte-level alphabet."""
    return [f"{_encode(a)} {_encode(b)}" for a, b in _MERGE_TEXT]


def add_tokenizer(writer: gguf.GGUFWriter) -> None:
    """Write the shared vocabulary's tokenizer.ggml.* keys into ``writer``."""
    tokens = vocab_tokens()
    assert len(tokens) == len(set(tokens)) == TOKENIZER.n_vocab, "merge results must be new, distinct tokens"
    types = [gguf.TokenType.NORMAL] * (len(tokens) - len(_SPECIALS)) + [gguf.TokenType.CONTROL] * len(_SPECIALS)
    writer.add_tokenizer_model(TOKENIZER.model)
    writer.add_tokenizer_pre(TOKENIZER.pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(vocab_merges())
    writer.add_bos_token_id(TOKENIZER.bos_id)
    writer.add_eos_token_id(TOKENIZER.eos_id)
    writer.add_mask_token_id(TOKENIZER.mask_id)
    writer.add_add_bos_token(TOKENIZER.add_bos)


# ----------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------

class _Weights:
    """Collects named F32 tensors drawn from one seeded generator.

    Shapes are numpy shapes, i.e. GGML's ``ne`` reversed: a matrix the loader declares as
    {n_in, n_out} is (n_out, n_in) here, an expert stack {n_in, n_out, n_expert} is
    (n_expert, n_out, n_in).
    """

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.tensors: dict[str, np.ndarray] = {}

    def put(self, name: str, value: np.ndarray) -> None:
        self.tensors[name] = value.astype(np.float32)

    def normal(self, name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> None:
        self.put(name, mean + std * self.rng.standard_normal(shape))

    def linear(self, name: str, shape: tuple[int, ...], gain: float = 1.0) -> None:
        # std 1/sqrt(fan_in) keeps each projection's output at the scale of its input.
        self.normal(name, shape, gain / np.sqrt(shape[-1]))

    def norm(self, name: str, n: int) -> None:
        # RMS-norm gains: near 1 (so nothing vanishes) but not exactly 1 (so a loader
        # that mixes up two norms gives different numbers).
        self.normal(name, (n,), 0.05, mean=1.0)

    def uniform(self, name: str, n: int, low: float, high: float) -> None:
        self.put(name, self.rng.uniform(low, high, n))

    def dt_bias(self, name: str, n: int) -> None:
        # The graph's time step is softplus(projection + dt_bias); dt_bias = softplus^-1(dt) with
        # dt log-uniform in [1e-3, 1e-1] is the usual Mamba-style init.
        dt = np.exp(self.rng.uniform(np.log(1e-3), np.log(1e-1), n))
        self.put(name, np.log(np.expm1(dt)))


def _embeddings(w: _Weights, s: TinySpec, n_vocab: int) -> None:
    w.normal("token_embd.weight", (n_vocab, s.n_embd), 1.0)
    w.norm("output_norm.weight", s.n_embd)
    # Output is untied; on a unit-RMS input this gives logits with std ~3: peaked, varied.
    w.linear("output.weight", (n_vocab, s.n_embd), gain=3.0)
    # Zero logits for the non-ASCII byte tokens: a lone byte >= 0x80 is invalid UTF-8, which
    # llama-server cannot put into JSON, so greedy text must stay ASCII to be served at all.
    w.tensors["output.weight"][0x80:0x100] = 0.0
    if s.zero_head:
        w.tensors["output.weight"][:] = 0.0


def _dense_layer(w: _Weights, s: TinySpec, il: int) -> None:
    """One llama / qwen3 block (create_llama_tensors / create_qwen3_tensors)."""
    p, q_dim, kv_dim = f"blk.{il}.", s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    w.norm(p + "attn_norm.weight", s.n_embd)
    w.linear(p + "attn_q.weight", (q_dim, s.n_embd))
    w.linear(p + "attn_k.weight", (kv_dim, s.n_embd))
    w.linear(p + "attn_v.weight", (kv_dim, s.n_embd))
    w.linear(p + "attn_output.weight", (s.n_embd, q_dim))
    if s.arch == "qwen3":
        w.norm(p + "attn_q_norm.weight", s.head_dim)
        w.norm(p + "attn_k_norm.weight", s.head_dim)
    w.norm(p + "ffn_norm.weight", s.n_embd)
    w.linear(p + "ffn_gate.weight", (s.n_ff, s.n_embd))
    w.linear(p + "ffn_up.weight", (s.n_ff, s.n_embd))
    w.linear(p + "ffn_down.weight", (s.n_embd, s.n_ff))


def _qwen35moe_layer(w: _Weights, s: TinySpec, il: int) -> None:
    """One qwen35moe block (create_qwen35moe_tensors)."""
    p = f"blk.{il}."
    w.norm(p + "attn_norm.weight", s.n_embd)
    # The graph uses post_attention_norm as the FFN's input norm.
    w.norm(p + "post_attention_norm.weight", s.n_embd)

    if not s.is_recurrent(il):
        # Gated attention: attn_q yields, per head, head_dim query values followed by
        # head_dim sigmoid-gate values for the attention output, hence 2x the rows.
        q_dim, kv_dim = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
        w.linear(p + "attn_q.weight", (2 * q_dim, s.n_embd))
        w.linear(p + "attn_k.weight", (kv_dim, s.n_embd))
        w.linear(p + "attn_v.weight", (kv_dim, s.n_embd))
        w.linear(p + "attn_output.weight", (s.n_embd, q_dim))
        w.norm(p + "attn_q_norm.weight", s.head_dim)
        w.norm(p + "attn_k_norm.weight", s.head_dim)
    else:
        # Gated DeltaNet. q, k: group_count heads of state_size; v and the output gate z:
        # time_step_rank heads of state_size. The causal conv runs over q|k|v together.
        key_dim = s.ssm_state_size * s.ssm_group_count
        value_dim = s.ssm_state_size * s.ssm_time_step_rank
        conv_dim = 2 * key_dim + value_dim
        n_v_heads = s.ssm_time_step_rank
        w.linear(p + "attn_qkv.weight", (conv_dim, s.n_embd))
        w.linear(p + "attn_gate.weight", (value_dim, s.n_embd))
        w.normal(p + "ssm_conv1d.weight", (conv_dim, s.ssm_conv_kernel), 1.0 / np.sqrt(s.ssm_conv_kernel))
        # Per value head: decay g = softplus(alpha + dt_bias) * ssm_a, state *= exp(g).
        # ssm_a = -A with A in [1, 16) and the Mamba-style dt_bias give decays of roughly 0.2 .. 1.
        w.dt_bias(p + "ssm_dt.bias", n_v_heads)
        w.uniform(p + "ssm_a", n_v_heads, -16.0, -1.0)
        w.linear(p + "ssm_beta.weight", (n_v_heads, s.n_embd))
        w.linear(p + "ssm_alpha.weight", (n_v_heads, s.n_embd))
        w.norm(p + "ssm_norm.weight", s.ssm_state_size)
        w.linear(p + "ssm_out.weight", (s.n_embd, value_dim))

    # MoE: router, routed experts (stacked), then the shared expert and its scalar gate.
    w.linear(p + "ffn_gate_inp.weight", (s.n_expert, s.n_embd))
    w.linear(p + "ffn_gate_exps.weight", (s.n_expert, s.n_ff_exp, s.n_embd))
    w.linear(p + "ffn_up_exps.weight", (s.n_expert, s.n_ff_exp, s.n_embd))
    w.linear(p + "ffn_down_exps.weight", (s.n_expert, s.n_embd, s.n_ff_exp))
    w.linear(p + "ffn_gate_inp_shexp.weight", (s.n_embd,))
    w.linear(p + "ffn_gate_shexp.weight", (s.n_ff_shexp, s.n_embd))
    w.linear(p + "ffn_up_shexp.weight", (s.n_ff_shexp, s.n_embd))
    w.linear(p + "ffn_down_shexp.weight", (s.n_embd, s.n_ff_shexp))


def _mamba_layer(w: _Weights, s: TinySpec, il: int) -> None:
    """One mamba block (create_mamba_tensors): ssm_in gives x|z, x goes through the causal
    conv (+ bias, silu) and the selective scan (dt, B, C from ssm_x, dt through ssm_dt), then
    y = (scan + D * x) * silu(z) goes back to n_embd through ssm_out."""
    p, d_inner, d_state, dt_rank = f"blk.{il}.", s.ssm_inner_size, s.ssm_state_size, s.ssm_time_step_rank
    w.norm(p + "attn_norm.weight", s.n_embd)
    w.linear(p + "ssm_in.weight", (2 * d_inner, s.n_embd))
    w.normal(p + "ssm_conv1d.weight", (d_inner, s.ssm_conv_kernel), 1.0 / np.sqrt(s.ssm_conv_kernel))
    w.normal(p + "ssm_conv1d.bias", (d_inner,), 0.1)
    w.linear(p + "ssm_x.weight", (dt_rank + 2 * d_state, d_inner))
    w.linear(p + "ssm_dt.weight", (d_inner, dt_rank))
    w.dt_bias(p + "ssm_dt.bias", d_inner)
    # Stored as A = -exp(A_log), as convert_hf_to_gguf writes it; S4D-real init: -1 .. -d_state.
    w.put(p + "ssm_a", -np.tile(np.arange(1, d_state + 1), (d_inner, 1)))
    w.normal(p + "ssm_d", (d_inner,), 0.05, mean=1.0)
    w.linear(p + "ssm_out.weight", (s.n_embd, d_inner))


_LAYERS = {"qwen35moe": _qwen35moe_layer, "mamba": _mamba_layer}  # the rest: _dense_layer


def _imrope_sections(n_rot: int) -> list[int]:
    """Split the n_rot/2 rotary frequencies over (time, height, width, extra) sections.

    Qwen3.5 uses 11:11:10 of its 32 pairs; scale that to our size. For text every
    token's position is the same on all axes, so the split only has to be valid.
    """
    half = n_rot // 2
    t = h = round(half * 11 / 32)
    return [t, h, half - t - h, 0]


# ----------------------------------------------------------------------------------------
# Writer
# ----------------------------------------------------------------------------------------

def _add_hparams(writer: gguf.GGUFWriter, s: TinySpec) -> None:
    writer.add_name(f"ikdflash-tiny-{s.arch}")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_block_count(s.n_layer)
    writer.add_context_length(s.n_ctx_train)
    writer.add_embedding_length(s.n_embd)
    if s.arch == "mamba":
        # No attention, no FFN, no RoPE. convert_hf_to_gguf writes head_count 0, but this base
        # sizes every layer's K cache as key_length x head_count_kv per cell, where Mamba keeps
        # its conv state ((conv_kernel - 1) x inner_size, the shape build_mamba reshapes it to):
        # with no heads it is empty, and context creation aborts on
        # GGML_ASSERT(ggml_nelements(a) == ne0*ne1) in build_mamba. One "head" as wide as the
        # conv state, and value_length 0 (the V cache then holds just the scan state), give both
        # caches the sizes the graph expects. No attention is built from them.
        writer.add_head_count(1)
        writer.add_head_count_kv(1)
        writer.add_key_length((s.ssm_conv_kernel - 1) * s.ssm_inner_size)
        writer.add_value_length(0)
        writer.add_feed_forward_length(0)
    else:
        writer.add_head_count(s.n_head)
        writer.add_head_count_kv(s.n_head_kv)
        # Explicit, because the loader's default head size is n_embd / n_head.
        writer.add_key_length(s.head_dim)
        writer.add_value_length(s.head_dim)
        writer.add_rope_dimension_count(s.n_rot)
        writer.add_rope_freq_base(s.rope_theta)
    writer.add_layer_norm_rms_eps(s.rms_eps)
    writer.add_vocab_size(TOKENIZER.n_vocab)
    if s.arch in ("llama", "qwen3"):
        writer.add_feed_forward_length(s.n_ff)
        return
    if s.arch == "qwen35moe":
        writer.add_expert_count(s.n_expert)
        writer.add_expert_used_count(s.n_expert_used)
        writer.add_expert_feed_forward_length(s.n_ff_exp)
        writer.add_expert_shared_feed_forward_length(s.n_ff_shexp)
        writer.add_full_attention_interval(s.full_attention_interval)
        writer.add_rope_dimension_sections(_imrope_sections(s.n_rot))
    writer.add_ssm_conv_kernel(s.ssm_conv_kernel)
    writer.add_ssm_inner_size(s.ssm_inner_size)
    writer.add_ssm_state_size(s.ssm_state_size)
    writer.add_ssm_time_step_rank(s.ssm_time_step_rank)
    if s.arch == "qwen35moe":
        # Not for mamba: with a group count the loader sizes the state as DeltaNet's.
        writer.add_ssm_group_count(s.ssm_group_count)


def build_tensors(spec: TinySpec) -> dict[str, np.ndarray]:
    """All of the model's tensors by GGUF name (numpy shapes), in file order."""
    w = _Weights(spec.seed)
    _embeddings(w, spec, TOKENIZER.n_vocab)
    layer = _LAYERS.get(spec.arch, _dense_layer)
    for il in range(spec.n_layer):
        layer(w, spec, il)
    return w.tensors


def _add_weight(writer: gguf.GGUFWriter, spec: TinySpec, name: str, value: np.ndarray) -> None:
    """A projection matrix in spec.weight_type; norms, embeddings and vectors stay F32."""
    qtype = gguf.GGMLQuantizationType[spec.weight_type]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if qtype == gguf.GGMLQuantizationType.F32 or value.ndim < 2 or name == "token_embd.weight" \
            or value.shape[-1] % block:
        writer.add_tensor(name, value)
        return
    writer.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)


def write_tiny_model(path: str | os.PathLike[str], spec: TinySpec | None = None, *,
                     arch: str | None = None, **overrides) -> Path:
    """Write a tiny random-weight GGUF model and return its path.

    Give a ``spec``, or an ``arch`` (plus any TinySpec field as a keyword); keywords and
    ``arch`` also override the fields of a given spec.
    """
    if spec is None:
        if arch is None:
            raise TypeError("write_tiny_model needs a spec or an arch")
        spec = TinySpec(arch=arch, **overrides)
    else:
        spec = dataclasses.replace(spec, **({"arch": arch} if arch else {}), **overrides)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), spec.arch)
    try:
        _add_hparams(writer, spec)
        add_tokenizer(writer)
        for name, value in build_tensors(spec).items():
            _add_weight(writer, spec, name, value)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return path
