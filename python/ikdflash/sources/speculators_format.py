"""Checkpoints saved by `speculators` (a `DSparkDraftModel`'s or a `DFlashDraftModel`'s
`save_pretrained`), read as the converter reads z-lab's: the nested layer config flattened, the
target layers renumbered, and a DSpark draft's own settings (docs/gguf.md, "DSpark").

The differences that matter, all from speculators 0.9.0:
  * `aux_hidden_state_layer_ids` index Hugging Face's `hidden_states`, where 0 is the embeddings:
    the fork's target layer ids are those minus 1;
  * a sliding layer's window is the `sliding_window` positions before the block, for every block
    row (z-lab's runs back from each row);
  * with `sample_from_anchor` (DSpark's default) the anchor's own row proposes, so a pass proposes
    `block_size` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

# HF name -> GGUF name (ik_llama.cpp's names for DSpark's heads)
DSPARK_TENSORS = {
    "markov_head.markov_w1.weight": "markov_w1.weight",
    "markov_head.markov_w2.weight": "markov_w2.weight",
    "confidence_head.proj.weight": "conf_proj.weight",
    "confidence_head.proj.bias": "conf_proj.bias",
}


@dataclass
class SpeculatorsSettings:
    """A speculators draft's layout, and DSpark's heads (0: none)."""

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


def is_speculators_checkpoint(config: Mapping[str, Any]) -> bool:
    return "speculators_model_type" in config


def flatten(config: Mapping[str, Any], where: str, error: type[ValueError]) -> tuple[dict[str, Any], SpeculatorsSettings]:
    """(a z-lab-style DFlash config, the settings only speculators' drafts have); error(message)
    names the key at fault."""
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

    markov_rank = config.get("markov_rank", 0) if kind == "dspark" else 0
    if type(markov_rank) is not int or markov_rank < 0:
        raise error(f"{where}: markov_rank must be a non-negative integer, got {markov_rank!r}")
    if markov_rank and config.get("markov_head_type", "vanilla") != "vanilla":
        raise error(f"{where}: markov_head_type {config.get('markov_head_type')!r} is not supported (only 'vanilla')")
    confidence = kind == "dspark" and _flag(config, "enable_confidence_head", True, where, error)
    with_markov = confidence and _flag(config, "confidence_head_with_markov", True, where, error)
    if with_markov and not markov_rank:
        raise error(f"{where}: confidence_head_with_markov needs markov_rank > 0")
    hidden = layer.get("hidden_size")
    width = (hidden + markov_rank * with_markov) if confidence and type(hidden) is int else 0
    sliding = "sliding_attention" in (layer.get("layer_types") or [])
    return flat, SpeculatorsSettings(markov_rank=markov_rank, confidence_width=width,
                                anchor_first=_flag(config, "sample_from_anchor", kind == "dspark", where, error),
                                window_from_block=sliding)


def _flag(config: Mapping[str, Any], name: str, default: bool, where: str, error: type[ValueError]) -> bool:
    value = config.get(name, default)
    if not isinstance(value, bool):
        raise error(f"{where}: '{name}' must be true or false, got {value!r}")
    return value
