"""DSpark checkpoints in the two layouts published trainers save, read as the converter reads
z-lab's DFlash drafts: a z-lab-style config plus DSpark's own settings (docs/gguf.md, "DSpark").

**speculators 0.9.0** (`save_pretrained` of a `DSparkDraftModel` or `DFlashDraftModel`;
`speculators_model_type` at the top level):
  * the layer config is nested (`transformer_layer_config`);
  * `aux_hidden_state_layer_ids` index Hugging Face's `hidden_states`, where 0 is the embeddings:
    the fork's target layer ids are those minus 1;
  * a sliding layer's window is the `sliding_window` positions before the block, for every block
    row (z-lab's runs back from each row);
  * with `sample_from_anchor` (DSpark's default) the anchor's own row proposes, so a pass proposes
    `block_size` tokens.

**SpecForge 0.2.0** (architecture `DSparkDraftModel`, `dflash_config.projector_type: "dspark"`):
z-lab's config and numbering, DSpark's settings in `dflash_config`, not anchor-first (block rows
1.. propose, the anchor is the first row's previous token). Its earliest checkpoints keep the heads
under `logit_head.`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

# HF name -> GGUF name (ik_llama.cpp's names for DSpark's heads)
DSPARK_TENSORS = {
    f"{prefix}{hf}": gguf
    for prefix in ("", "logit_head.")
    for hf, gguf in {"markov_head.markov_w1.weight": "markov_w1.weight",
                     "markov_head.markov_w2.weight": "markov_w2.weight",
                     "confidence_head.proj.weight": "conf_proj.weight",
                     "confidence_head.proj.bias": "conf_proj.bias"}.items()
}


@dataclass
class DsparkSettings:
    """A DSpark layout's settings, and its heads (0: none)."""

    markov_rank: int
    confidence_width: int  # hidden_size, hidden_size + markov_rank, or 0
    anchor_first: bool
    window_from_block: bool

    def tensor_shapes(self, n_embd: int, n_vocab: int) -> dict[str, tuple[int, ...]]:
        """GGUF name -> Hugging Face shape of the heads this draft has."""
        shapes: dict[str, tuple[int, ...]] = {}
        if self.markov_rank:
            shapes |= {"markov_w1.weight": (n_vocab, self.markov_rank), "markov_w2.weight": (n_vocab, self.markov_rank)}
        if self.confidence_width:
            shapes |= {"conf_proj.weight": (1, self.confidence_width), "conf_proj.bias": (1,)}
        return shapes


def read(config: Mapping[str, Any], where: str,
         error: type[ValueError]) -> tuple[Mapping[str, Any], DsparkSettings | None]:
    """(a z-lab-style DFlash config, its DSpark settings); a z-lab config comes back as it is, with
    None. error(message) names the key at fault."""
    if "speculators_model_type" in config:
        return _from_speculators(config, where, error)
    nested = config.get("dflash_config")
    if isinstance(nested, dict) and nested.get("projector_type") == "dspark":
        return _from_specforge(config, nested, where, error)
    if "DSparkDraftModel" in (config.get("architectures") or []):
        raise error(f"{where}: a DSparkDraftModel config without speculators_model_type or "
                    "dflash_config.projector_type 'dspark': neither speculators' layout nor SpecForge's")
    return config, None


def _from_speculators(config: Mapping[str, Any], where: str,
                      error: type[ValueError]) -> tuple[dict[str, Any], DsparkSettings]:
    kind = config.get("speculators_model_type")
    if kind not in ("dspark", "dflash"):
        raise error(f"{where}: speculators_model_type {kind!r} is not supported (expected 'dspark' or 'dflash')")
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise error(f"{where}: missing required object 'transformer_layer_config'")
    flat: dict[str, Any] = dict(layer)
    flat["architectures"] = ["DFlashDraftModel"]
    vocab, draft_vocab = layer.get("vocab_size"), config.get("draft_vocab_size", layer.get("vocab_size"))
    if draft_vocab != vocab:
        raise error(f"{where}: draft_vocab_size {draft_vocab} differs from the target's {vocab}: drafts with a "
                    "reduced vocabulary (their own lm_head, d2t) are not supported")
    aux = config.get("aux_hidden_state_layer_ids")
    if not isinstance(aux, list) or not aux or not all(type(i) is int for i in aux):
        raise error(f"{where}: aux_hidden_state_layer_ids must be a list of layer ids")
    if 0 in aux:
        raise error(f"{where}: aux_hidden_state_layer_ids includes 0, the target's embeddings, which the fork "
                    "does not capture")
    flat["target_layer_ids"] = [i - 1 for i in aux]
    for name in ("block_size", "mask_token_id", "head_token_ids"):
        if name in config:
            flat[name] = config[name]
    if _flag(config, "sliding_window_non_causal", False, where, error):
        flat["is_causal"] = False
    heads = config if kind == "dspark" else {"markov_rank": 0, "enable_confidence_head": False}
    sliding = "sliding_attention" in (layer.get("layer_types") or [])
    return flat, _settings(heads, layer.get("hidden_size"), where, error,
                           anchor_first=_flag(config, "sample_from_anchor", kind == "dspark", where, error),
                           window_from_block=sliding, confidence_default=True, with_markov_default=True)


def _from_specforge(config: Mapping[str, Any], nested: Mapping[str, Any], where: str,
                    error: type[ValueError]) -> tuple[dict[str, Any], DsparkSettings]:
    flat = dict(config)
    flat["architectures"] = ["DFlashDraftModel"]
    alpha = nested.get("confidence_head_alpha", 0.0) or 0.0
    if type(alpha) not in (int, float):
        raise error(f"{where}: 'confidence_head_alpha' must be a number, got {alpha!r}")
    return flat, _settings(nested, config.get("hidden_size"), where, error, anchor_first=False,
                           window_from_block=False, confidence_default=alpha > 0, with_markov_default=False)


def _settings(heads: Mapping[str, Any], hidden: Any, where: str, error: type[ValueError], *, anchor_first: bool,
              window_from_block: bool, confidence_default: bool, with_markov_default: bool) -> DsparkSettings:
    """The heads a layout's keys describe; each trainer has its own defaults for the confidence head."""
    markov_rank = heads.get("markov_rank", 0) or 0
    if type(markov_rank) is not int or markov_rank < 0:
        raise error(f"{where}: markov_rank must be a non-negative integer, got {markov_rank!r}")
    if markov_rank and heads.get("markov_head_type", "vanilla") != "vanilla":
        raise error(f"{where}: markov_head_type {heads.get('markov_head_type')!r} is not supported (only 'vanilla')")
    confidence = _flag(heads, "enable_confidence_head", confidence_default, where, error)
    with_markov = confidence and _flag(heads, "confidence_head_with_markov", with_markov_default, where, error)
    if with_markov and not markov_rank:
        raise error(f"{where}: confidence_head_with_markov needs markov_rank > 0")
    width = (hidden + markov_rank * with_markov) if confidence and type(hidden) is int else 0
    return DsparkSettings(markov_rank=markov_rank, confidence_width=width, anchor_first=anchor_first,
                          window_from_block=window_from_block)


def _flag(config: Mapping[str, Any], name: str, default: bool, where: str, error: type[ValueError]) -> bool:
    value = config.get(name, default)
    if not isinstance(value, bool):
        raise error(f"{where}: '{name}' must be true or false, got {value!r}")
    return value
