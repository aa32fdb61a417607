// DFlash draft: reading and checking the GGUF (every header value a graph uses), checking it
// against its target, placing it on a backend, and the C API that loads a draft and reports it.

#include "dflash-draft-state.h"

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

using dflash_impl::block_conv;
using dflash_impl::check_gguf_layout;
using dflash_impl::codebook;
using dflash_impl::dflash_error;
using dflash_impl::draft_format;
using dflash_impl::draft_layer;
using dflash_impl::fail;
using dflash_impl::guarded;
using dflash_impl::k_max_graph_nodes;

namespace {

constexpr int k_conv_nodes_per_tap = 12;
// Bounds on what a draft file may claim, far above any real draft (DFlash drafts have a handful
// of layers and blocks of 16): a step's graph holds k_max_graph_nodes, and sizes multiply.
constexpr int64_t k_max_layers = 64;
constexpr int64_t k_max_block = 256;
constexpr int64_t k_max_width = 1 << 16;   // embedding, ffn, heads x head size
constexpr int64_t k_max_heads = 1024;
constexpr int64_t k_max_target_layers = 256;
constexpr int64_t k_max_conv_taps = 16;

// --- GGUF metadata helpers -------------------------------------------------------------------

struct gguf_meta {
    gguf_context * ctx;
    std::string prefix;  // "<arch>."

    int find(const std::string & key) const { return gguf_find_key(ctx, key.c_str()); }
    bool has(const std::string & key) const { return find(key) >= 0; }

    int64_t integer(const std::string & key, int64_t fallback, bool required = false) const {
        const int id = find(key);
        if (id < 0) {
            if (required) {
                fail("missing required key '%s'", key.c_str());
            }
            return fallback;
        }
        switch (gguf_get_kv_type(ctx, id)) {
            case GGUF_TYPE_UINT32: return gguf_get_val_u32(ctx, id);
            case GGUF_TYPE_INT32:  return gguf_get_val_i32(ctx, id);
            case GGUF_TYPE_UINT64: return (int64_t) gguf_get_val_u64(ctx, id);
            case GGUF_TYPE_INT64:  return gguf_get_val_i64(ctx, id);
            default: fail("key '%s' is not an integer", key.c_str());
        }
    }

    bool flag(int id, const std::string & key) const {
        if (gguf_get_kv_type(ctx, id) != GGUF_TYPE_BOOL) {
            fail("key '%s' is not a bool", key.c_str());
        }
        return gguf_get_val_bool(ctx, id);
    }

    // The strings of an array key (its length checked by the caller).
    int string_array(const std::string & key) const {
        const int id = find(key);
        if (id >= 0 && (gguf_get_kv_type(ctx, id) != GGUF_TYPE_ARRAY || gguf_get_arr_type(ctx, id) != GGUF_TYPE_STRING)) {
            fail("key '%s' is not an array of strings", key.c_str());
        }
        return id;
    }

    // An integer key that must lie in [lo, hi]; a missing optional key gives fallback.
    int bounded(const std::string & key, int64_t fallback, int64_t lo, int64_t hi, bool required = false) const {
        const int64_t v = integer(key, fallback, required);
        if (has(key) && (v < lo || v > hi)) {
            fail("key '%s' is %lld, outside %lld..%lld", key.c_str(), (long long) v, (long long) lo, (long long) hi);
        }
        return (int) v;
    }

    // A float key, finite and at least lo (above it when strict); a missing key gives fallback.
    // ggml's ops assert on some values (a norm's epsilon of 0 or NaN), so every one is checked.
    float real(const std::string & key, float fallback, float lo = -FLT_MAX, bool strict = false) const {
        const int id = find(key);
        if (id < 0) {
            return fallback;
        }
        if (gguf_get_kv_type(ctx, id) != GGUF_TYPE_FLOAT32) {
            fail("key '%s' is not a float32", key.c_str());
        }
        const float v = gguf_get_val_f32(ctx, id);
        if (!std::isfinite(v)) {
            fail("key '%s' is %g, not a finite number", key.c_str(), v);
        }
        if (v < lo || (strict && v == lo)) {
            fail("key '%s' is %g, not %s %g", key.c_str(), v, strict ? "above" : "at least", lo);
        }
        return v;
    }

    // Integer or bool array (a scalar is repeated n times when n > 0).
    std::vector<int64_t> integers(const std::string & key, int n = 0) const {
        const int id = find(key);
        std::vector<int64_t> out;
        if (id < 0) {
            return out;
        }
        if (gguf_get_kv_type(ctx, id) != GGUF_TYPE_ARRAY) {
            out.assign(std::max(n, 1), gguf_get_kv_type(ctx, id) == GGUF_TYPE_BOOL ? gguf_get_val_bool(ctx, id)
                                                                                   : integer(key, 0));
            return out;
        }
        const size_t len = gguf_get_arr_n(ctx, id);
        if (len > (size_t) k_max_target_layers + k_max_layers) {
            fail("key '%s' has %zu entries: corrupt", key.c_str(), len);
        }
        const int type = gguf_get_arr_type(ctx, id);
        if (type != GGUF_TYPE_BOOL && type != GGUF_TYPE_INT32 && type != GGUF_TYPE_UINT32) {
            fail("key '%s' must be an array of integers or bools", key.c_str());
        }
        const void * data = gguf_get_arr_data(ctx, id);
        for (size_t i = 0; i < len; ++i) {
            switch (type) {
                case GGUF_TYPE_BOOL:  out.push_back(((const int8_t *) data)[i] != 0); break;
                case GGUF_TYPE_INT32: out.push_back(((const int32_t *) data)[i]); break;
                default:              out.push_back(((const uint32_t *) data)[i]); break;
            }
        }
        return out;
    }
};

// The token ids of an integer array key: increasing, each in [0, n_vocab) (empty when absent).
std::vector<llama_token> read_token_ids(const gguf_meta & m, const std::string & key, int n_vocab) {
    const int id = m.find(key);
    std::vector<llama_token> out;
    if (id < 0) {
        return out;
    }
    const int type = gguf_get_kv_type(m.ctx, id) == GGUF_TYPE_ARRAY ? gguf_get_arr_type(m.ctx, id) : -1;
    if (type != GGUF_TYPE_INT32 && type != GGUF_TYPE_UINT32) {
        fail("key '%s' must be an array of int32 token ids", key.c_str());
    }
    const size_t n = gguf_get_arr_n(m.ctx, id);
    if (n < 1 || n > (size_t) n_vocab) {
        fail("key '%s' lists %zu token ids; a vocabulary of %d has 1..%d", key.c_str(), n, n_vocab, n_vocab);
    }
    const void * data = gguf_get_arr_data(m.ctx, id);
    for (size_t i = 0; i < n; ++i) {
        const int64_t t = type == GGUF_TYPE_INT32 ? ((const int32_t *) data)[i] : ((const uint32_t *) data)[i];
        if (t < 0 || t >= n_vocab || (i > 0 && t <= out.back())) {
            fail("key '%s': entry %zu (%lld) is outside the vocabulary (%d tokens) or not above the one before it",
                 key.c_str(), i, (long long) t, n_vocab);
        }
        out.push_back((llama_token) t);
    }
    return out;
}

// DFlash2's keys (after "<arch>.") and tensors, as ik_llama.cpp names them.
constexpr const char * k_key_conv_taps = "conv_kernel_size";
constexpr const char * k_key_conv_group = "conv_group_size";
constexpr const char * k_key_selector_rank = "selector_rank";
constexpr const char * k_key_selector_top_k = "selector_top_k";

// (after "blk.N.attn_" or "blk.N.ffn_")
constexpr const char * k_tensor_conv_base = "conv_base";  // no ".weight", as written upstream
constexpr const char * k_tensor_conv_proj = "conv_proj.weight";
constexpr const char * k_tensor_selector_hidden = "selector_hidden.weight";
constexpr const char * k_tensor_selector_predecessor = "selector_predecessor.weight";
constexpr const char * k_tensor_selector_successor = "selector_successor.weight";
// DSpark's (ik_llama.cpp's names; the key as llama.cpp writes it in the flat layout, under
// "dflash." in ik_llama.cpp's)
constexpr const char * k_key_sample_from_anchor = "sample_from_anchor";
constexpr const char * k_tensor_markov_w1 = "markov_w1.weight";
constexpr const char * k_tensor_markov_w2 = "markov_w2.weight";
constexpr const char * k_tensor_confidence_w = "conf_proj.weight";
constexpr const char * k_tensor_confidence_b = "conf_proj.bias";
constexpr int k_dspark_nodes_per_row = 10;
const draft_format k_formats[] = {
    {"dflash-draft", "dflash_fc.weight", "dflash_hidden_norm.weight", "post_attention_norm",
     "dflash.input_embedding_scale", "dflash.output_multiplier"},
    {"dflash",       "fc.weight",        "enc.output_norm.weight",    "ffn_norm",
     "embedding_scale", "logit_scale"},
};

}  // namespace

namespace {

// --- loading ---------------------------------------------------------------------------------

// DFlash2's four keys: all of them (a DFlash2 draft) or none (DFlash1). The selector's top-K is
// checked against the target's vocabulary in check_against_target.
void read_dflash2_hparams(dflash_draft & d, const gguf_meta & m) {
    const std::string & p = m.prefix;
    const char * keys[] = {k_key_conv_taps, k_key_conv_group, k_key_selector_rank, k_key_selector_top_k};
    if (std::none_of(std::begin(keys), std::end(keys), [&](const char * k) { return m.has(p + k); })) {
        return;
    }
    d.conv_taps = m.bounded(p + k_key_conv_taps, 0, 1, k_max_conv_taps, true);
    d.conv_group = m.bounded(p + k_key_conv_group, 0, 1, d.n_embd, true);
    d.selector_rank = m.bounded(p + k_key_selector_rank, 0, 1, k_max_width, true);
    d.selector_top_k = m.bounded(p + k_key_selector_top_k, 0, 1, INT32_MAX, true);
    if (d.n_embd % d.conv_group != 0) {
        fail("key '%s%s' is %d, which does not divide the embedding width %d", p.c_str(), k_key_conv_group,
             d.conv_group, d.n_embd);
    }
    d.graph_nodes += d.n_layer * 4 * d.conv_taps * k_conv_nodes_per_tap;
}

// DSpark's layout keys; its heads are told by their tensors (bind_dspark_tensors). A file with a
// Markov head and no sample_from_anchor key is anchor-first, as DSpark drafts are by default.
void read_dspark_hparams(dflash_draft & d, const gguf_meta & m) {
    const std::string anchor_key = m.prefix + (d.format == &k_formats[0] ? "dflash." : "") + k_key_sample_from_anchor;
    const int anchor_id = m.find(anchor_key);
    d.anchor_first = anchor_id >= 0 ? m.flag(anchor_id, anchor_key) : gguf_find_tensor(m.ctx, k_tensor_markov_w1) >= 0;
    const std::string window_key = m.prefix + "dflash.window_from_block";
    const int window_id = m.find(window_key);
    d.window_from_block = window_id >= 0 && m.flag(window_id, window_key);
}

void read_hparams(dflash_draft & d, const gguf_meta & m) {
    const std::string & p = m.prefix;
    d.n_layer = m.bounded(p + "block_count", 0, 1, k_max_layers, true);
    d.n_embd = m.bounded(p + "embedding_length", 0, 1, k_max_width, true);
    d.n_ff = m.bounded(p + "feed_forward_length", 0, 1, k_max_width, true);
    d.n_head = m.bounded(p + "attention.head_count", 0, 1, k_max_heads, true);
    d.n_head_kv = m.bounded(p + "attention.head_count_kv", d.n_head, 1, k_max_heads);
    d.head_dim = m.bounded(p + "attention.key_length", d.n_embd / d.n_head, 1, k_max_width);
    d.n_ctx_train = m.bounded(p + "context_length", 0, 0, INT32_MAX);
    d.rms_eps = m.real(p + "attention.layer_norm_rms_epsilon", -1.0f, 0.0f, true);
    d.rope_base = m.real(p + "rope.freq_base", 10000.0f, 0.0f, true);
    if (d.n_layer < 1 || d.n_embd < 1 || d.n_head < 1 || d.n_head_kv < 1 || d.head_dim < 1 || d.n_ff < 1) {
        fail("invalid sizes: %d layers, embedding %d, %d/%d heads of %d, ffn %d", d.n_layer, d.n_embd, d.n_head,
             d.n_head_kv, d.head_dim, d.n_ff);
    }
    if ((int64_t) d.n_head * d.head_dim > k_max_width) {
        fail("%d heads of %d exceed %lld", d.n_head, d.head_dim, (long long) k_max_width);
    }
    if (d.n_head % d.n_head_kv != 0) {
        fail("%d query heads are not a multiple of %d kv heads", d.n_head, d.n_head_kv);
    }
    if (d.rms_eps <= 0.0f) {
        fail("missing required key '%sattention.layer_norm_rms_epsilon'", p.c_str());
    }
    if (m.integer(p + "attention.value_length", d.head_dim) != d.head_dim) {
        fail("value_length differs from key_length: not supported");
    }
    const int64_t n_rot = m.integer(p + "rope.dimension_count", d.head_dim);
    if (n_rot != d.head_dim) {
        fail("partial rotary embedding (rope.dimension_count %d of head %d) is not supported", (int) n_rot, d.head_dim);
    }

    d.block_size = m.bounded(p + "block_size", 16, 2, k_max_block);
    if (m.has(p + "dflash.block_size")) {
        d.block_size = m.bounded(p + "dflash.block_size", 16, 2, k_max_block);
    }

    std::vector<int64_t> ids;
    if (d.format == &k_formats[0]) {
        d.mask_token = m.bounded(p + "dflash.mask_token_id", -1, 0, INT32_MAX, true);
        ids = m.integers(p + "dflash.target_layer_ids");
        if (ids.empty()) {
            fail("missing required key '%sdflash.target_layer_ids'", p.c_str());
        }
    } else {
        // upstream llama.cpp: the mask id moved to the tokenizer section, and files that have it
        // there number target layers from 1 (the input of layer id+1); older files use 0-based ids
        const bool newer = m.has("tokenizer.ggml.mask_token_id");
        d.mask_token = m.bounded(newer ? "tokenizer.ggml.mask_token_id" : p + "mask_token_id", -1, 0, INT32_MAX, true);
        ids = m.integers(p + "target_layers");
        if (ids.empty()) {
            fail("missing required key '%starget_layers'", p.c_str());
        }
        for (auto & id : ids) {
            id -= newer ? 1 : 0;
        }
    }
    if ((int64_t) ids.size() > k_max_target_layers) {
        fail("%zu target layer ids: corrupt", ids.size());
    }
    for (int64_t id : ids) {
        if (id < 0 || id >= k_max_target_layers) {
            fail("target layer id %lld is outside 0..%lld", (long long) id, (long long) k_max_target_layers - 1);
        }
        if (std::count(ids.begin(), ids.end(), id) > 1) {
            fail("target layer id %d is listed twice", (int) id);
        }
        d.target_ids.push_back((int) id);
    }

    d.window = m.bounded(p + "attention.sliding_window", 0, 0, INT32_MAX);
    std::vector<int64_t> pattern = m.integers(p + "attention.sliding_window_pattern", d.n_layer);
    if (d.window > 0 && pattern.empty()) {
        pattern.assign(d.n_layer, 1);  // a window without a pattern applies to every layer
    }
    if (!pattern.empty() && (int) pattern.size() != d.n_layer) {
        fail("sliding_window_pattern has %d entries for %d layers", (int) pattern.size(), d.n_layer);
    }
    d.sliding.assign(d.n_layer, false);
    for (int il = 0; il < (int) pattern.size() && d.window > 0; ++il) {
        d.sliding[il] = pattern[il] != 0;
    }
    // causality: stated by the checkpoint for every layer, else sliding layers are causal
    const std::string causal_key = p + "dflash.is_causal";
    const int causal_id = m.find(causal_key);
    for (int il = 0; il < d.n_layer; ++il) {
        d.causal.push_back(causal_id >= 0 ? m.flag(causal_id, causal_key) : (bool) d.sliding[il]);
    }
    read_dflash2_hparams(d, m);
    read_dspark_hparams(d, m);
    d.embedding_scale = m.real(p + d.format->embedding_scale, 1.0f);
    d.output_multiplier = m.real(p + d.format->output_multiplier, 1.0f);
    d.logit_softcap = m.real(p + "dflash.final_logit_softcapping", m.real(p + "final_logit_softcapping", 0.0f, 0.0f),
                             0.0f);
}

// The weight types the draft's graph computes with: F32 norms; matrices in these types.
bool is_matrix_type(ggml_type type) {
    switch (type) {
        case GGML_TYPE_F32: case GGML_TYPE_F16: case GGML_TYPE_BF16: case GGML_TYPE_Q8_0: case GGML_TYPE_Q4_0:
        case GGML_TYPE_Q4_1: case GGML_TYPE_Q5_0: case GGML_TYPE_Q5_1: case GGML_TYPE_Q2_K: case GGML_TYPE_Q3_K:
        case GGML_TYPE_Q4_K: case GGML_TYPE_Q5_K: case GGML_TYPE_Q6_K:
            return true;
        default:
            return false;
    }
}

// A tensor of the given shape; vectors (and f32_only tensors) in F32, matrices in a matrix type.
ggml_tensor * expect_tensor(ggml_context * ctx, const std::string & name, std::initializer_list<int64_t> shape,
                            std::map<std::string, bool> & claimed, bool required = true, bool f32_only = false) {
    ggml_tensor * t = ggml_get_tensor(ctx, name.c_str());
    if (t == nullptr) {
        if (required) {
            fail("missing tensor '%s'", name.c_str());
        }
        return nullptr;
    }
    int i = 0;
    for (int64_t n : shape) {
        if (t->ne[i] != n) {
            fail("tensor '%s' has shape [%lld, %lld, %lld], expected dimension %d to be %lld", name.c_str(),
                 (long long) t->ne[0], (long long) t->ne[1], (long long) t->ne[2], i, (long long) n);
        }
        ++i;
    }
    if (ggml_n_dims(t) > (int) shape.size()) {
        fail("tensor '%s' has %d dimensions, expected %zu", name.c_str(), ggml_n_dims(t), shape.size());
    }
    const bool f32 = f32_only || shape.size() == 1;
    if (f32 ? t->type != GGML_TYPE_F32 : !is_matrix_type(t->type)) {
        fail("tensor '%s' has type %s, %s", name.c_str(), ggml_type_name(t->type),
             f32 ? "expected f32" : "not one the draft computes with (f32, f16, bf16, q8_0, q4/q5, k-quants)");
    }
    claimed[name] = true;
    return t;
}

void bind_dflash2_tensors(dflash_draft & d, std::map<std::string, bool> & claimed) {
    ggml_context * ctx = d.ctx_w;
    const int64_t n_dynamic = 2LL * d.conv_taps * (d.n_embd / d.conv_group);
    auto conv = [&](const std::string & prefix) {
        return block_conv{expect_tensor(ctx, prefix + k_tensor_conv_base, {d.n_embd, d.conv_taps, 2}, claimed, true, true),
                          expect_tensor(ctx, prefix + k_tensor_conv_proj, {d.n_embd, n_dynamic}, claimed)};
    };
    for (int il = 0; il < d.n_layer; ++il) {
        const std::string b = "blk." + std::to_string(il) + ".";
        d.layers[il].attn_conv = conv(b + "attn_");
        d.layers[il].ffn_conv = conv(b + "ffn_");
    }
    d.selector_hidden = expect_tensor(ctx, k_tensor_selector_hidden, {d.n_embd, d.selector_rank}, claimed);
    d.predecessors.tensor = expect_tensor(ctx, k_tensor_selector_predecessor, {d.selector_rank, d.n_vocab}, claimed);
    d.successors.tensor = expect_tensor(ctx, k_tensor_selector_successor, {d.selector_rank, d.n_vocab}, claimed);
    for (const codebook * cb : {&d.predecessors, &d.successors}) {
        if (cb->tensor->ne[0] % ggml_blck_size(cb->tensor->type) != 0) {
            fail("tensor '%s' is stored as %s, whose blocks do not fit its rows of %lld", ggml_get_name(cb->tensor),
                 ggml_type_name(cb->tensor->type), (long long) cb->tensor->ne[0]);
        }
    }
}

// DSpark's heads: W1 and W2 of one rank (W2 scores the whole vocabulary; the head cut applies to
// it as to the head), and a confidence head over the hidden state, or over it and W1's row.
void bind_dspark_tensors(dflash_draft & d, std::map<std::string, bool> & claimed) {
    ggml_context * ctx = d.ctx_w;
    const ggml_tensor * w1 = ggml_get_tensor(ctx, k_tensor_markov_w1);
    const ggml_tensor * w2 = ggml_get_tensor(ctx, k_tensor_markov_w2);
    if ((w1 == nullptr) != (w2 == nullptr)) {
        fail("tensor '%s' has no '%s': a Markov head needs both", w1 ? k_tensor_markov_w1 : k_tensor_markov_w2,
             w1 ? k_tensor_markov_w2 : k_tensor_markov_w1);
    }
    if (w1 != nullptr) {
        d.markov_rank = (int) w1->ne[0];
        if (d.markov_rank < 1 || d.markov_rank > k_max_width) {
            fail("tensor '%s' has rank %d, outside 1..%lld", k_tensor_markov_w1, d.markov_rank, (long long) k_max_width);
        }
        if (w2->ne[0] != d.markov_rank) {
            fail("tensor '%s' has rank %lld but '%s' has rank %d: the Markov head's factors must agree",
                 k_tensor_markov_w2, (long long) w2->ne[0], k_tensor_markov_w1, d.markov_rank);
        }
        d.markov_prev = expect_tensor(ctx, k_tensor_markov_w1, {d.markov_rank, d.n_vocab}, claimed);
        d.markov_bias = expect_tensor(ctx, k_tensor_markov_w2, {d.markov_rank, d.n_vocab}, claimed);
        d.markov_prev_scored = d.markov_prev;  // until a cut head takes its rows (cut_head)
        if (d.markov_rank % ggml_blck_size(d.markov_prev->type) != 0) {
            fail("tensor '%s' is stored as %s, whose blocks do not fit its rank %d", k_tensor_markov_w1,
                 ggml_type_name(d.markov_prev->type), d.markov_rank);
        }
    }
    const ggml_tensor * cw = ggml_get_tensor(ctx, k_tensor_confidence_w);
    if (cw != nullptr) {
        const int64_t width = cw->ne[0];
        if (width != d.n_embd && width != (int64_t) d.n_embd + d.markov_rank) {
            fail("tensor '%s' is %lld wide: expected the embedding width %d%s", k_tensor_confidence_w,
                 (long long) width, d.n_embd,
                 d.markov_rank ? (" or it plus the Markov rank, " + std::to_string(d.n_embd + d.markov_rank)).c_str() : "");
        }
        d.confidence_w = expect_tensor(ctx, k_tensor_confidence_w, {width, 1}, claimed);
        d.confidence_b = expect_tensor(ctx, k_tensor_confidence_b, {1}, claimed);
    } else if (ggml_get_tensor(ctx, k_tensor_confidence_b) != nullptr) {
        fail("tensor '%s' has no '%s'", k_tensor_confidence_b, k_tensor_confidence_w);
    }
    if (d.is_dflash2() && (d.is_dspark() || d.anchor_first)) {
        fail("the draft has DFlash2's selector and DSpark's %s: not a draft either defines",
             d.anchor_first ? "anchor-first layout" : "heads");
    }
    if (d.is_dspark()) {
        d.graph_nodes += d.block_size * k_dspark_nodes_per_row;
    }
}

void bind_tensors(dflash_draft & d, const llama_model * target) {
    ggml_context * ctx = d.ctx_w;
    std::map<std::string, bool> claimed;
    const int q_dim = d.head_dim * d.n_head, kv_dim = d.head_dim * d.n_head_kv;
    d.fc = expect_tensor(ctx, d.format->fc, {d.n_target_features, d.n_embd}, claimed);
    d.hidden_norm = expect_tensor(ctx, d.format->hidden_norm, {d.n_embd}, claimed);
    d.output_norm = expect_tensor(ctx, "output_norm.weight", {d.n_embd}, claimed);
    d.tok_embd = expect_tensor(ctx, "token_embd.weight", {d.n_embd, d.n_vocab}, claimed, false);
    d.output = expect_tensor(ctx, "output.weight", {d.n_embd, d.n_vocab}, claimed, false);
    for (int il = 0; il < d.n_layer; ++il) {
        const std::string b = "blk." + std::to_string(il) + ".";
        draft_layer l;
        l.attn_norm = expect_tensor(ctx, b + "attn_norm.weight", {d.n_embd}, claimed);
        l.ffn_norm = expect_tensor(ctx, b + d.format->ffn_norm + ".weight", {d.n_embd}, claimed);
        l.wq = expect_tensor(ctx, b + "attn_q.weight", {d.n_embd, q_dim}, claimed);
        l.wk = expect_tensor(ctx, b + "attn_k.weight", {d.n_embd, kv_dim}, claimed);
        l.wv = expect_tensor(ctx, b + "attn_v.weight", {d.n_embd, kv_dim}, claimed);
        l.wo = expect_tensor(ctx, b + "attn_output.weight", {q_dim, d.n_embd}, claimed);
        l.q_norm = expect_tensor(ctx, b + "attn_q_norm.weight", {d.head_dim}, claimed);
        l.k_norm = expect_tensor(ctx, b + "attn_k_norm.weight", {d.head_dim}, claimed);
        l.ffn_gate = expect_tensor(ctx, b + "ffn_gate.weight", {d.n_embd, d.n_ff}, claimed);
        l.ffn_up = expect_tensor(ctx, b + "ffn_up.weight", {d.n_embd, d.n_ff}, claimed);
        l.ffn_down = expect_tensor(ctx, b + "ffn_down.weight", {d.n_ff, d.n_embd}, claimed);
        d.layers.push_back(l);
    }
    if (d.is_dflash2()) {
        bind_dflash2_tensors(d, claimed);
    }
    bind_dspark_tensors(d, claimed);
    for (ggml_tensor * t = ggml_get_first_tensor(ctx); t != nullptr; t = ggml_get_next_tensor(ctx, t)) {
        if (!claimed.count(ggml_get_name(t))) {
            fail("unexpected tensor '%s' (biases and other extras are not supported)", ggml_get_name(t));
        }
    }
    if (d.output != nullptr && d.tok_embd == nullptr) {
        fail("the draft has output.weight but no token_embd.weight");
    }
    // borrow what the draft does not carry: the target's embedding table and head (graph ops
    // take tensors as non-const; the draft only reads them)
    ggml_tensor * target_embd = const_cast<ggml_tensor *>(llama_model_token_embd(target));
    if (d.tok_embd == nullptr) {
        d.tok_embd = target_embd;
    }
    if (d.output == nullptr) {
        d.output = d.tok_embd == target_embd ? const_cast<ggml_tensor *>(llama_model_output(target)) : d.tok_embd;
    }
    if (d.tok_embd->ne[0] != d.n_embd) {
        fail("the target's embedding width %lld differs from the draft's %d; the draft cannot use the target's "
             "token embeddings", (long long) d.tok_embd->ne[0], d.n_embd);
    }
}

void check_against_target(dflash_draft & d, const gguf_meta & m, const llama_model * target) {
    if (llama_model_is_recurrent(target)) {
        // hybrid targets are fine: their attention layers roll back, and the recurrent state is
        // snapshotted and replayed; a state-only target has nothing to roll back to
        fail("the target is a recurrent model without attention layers (Mamba-style): its state cannot be "
             "rolled back to the accepted tokens, so drafts cannot be verified on it");
    }
    const int n_vocab = llama_n_vocab(target);
    const int tokens_id = m.string_array("tokenizer.ggml.tokens");
    if (tokens_id < 0) {
        fail("the draft has no tokenizer (tokenizer.ggml.tokens); convert it with the target's tokenizer");
    }
    const size_t n_draft_vocab = gguf_get_arr_n(m.ctx, tokens_id);
    if (n_draft_vocab != (size_t) n_vocab) {
        fail("vocabulary size %zu differs from the target's %d: this draft was made for another target",
             n_draft_vocab, n_vocab);
    }
    for (int i = 0; i < n_vocab; ++i) {
        if (strcmp(gguf_get_arr_str(m.ctx, tokens_id, i), llama_token_get_text(target, i)) != 0) {
            fail("token %d is '%s' in the draft but '%s' in the target: the vocabularies differ", i,
                 gguf_get_arr_str(m.ctx, tokens_id, i), llama_token_get_text(target, i));
        }
    }
    d.n_vocab = n_vocab;
    d.head_ids = read_token_ids(m, m.prefix + "dflash.head_token_ids", n_vocab);
    if (d.selector_top_k > n_vocab) {
        fail("key '%s%s' is %d, above the vocabulary's %d tokens", m.prefix.c_str(), k_key_selector_top_k,
             d.selector_top_k, n_vocab);
    }
    if (d.mask_token < 0 || d.mask_token >= n_vocab) {
        fail("mask token %d is outside the vocabulary (%d tokens)", d.mask_token, n_vocab);
    }
    const int n_target_layers = llama_n_layer(target);
    for (int id : d.target_ids) {
        if (id >= n_target_layers) {
            fail("target layer id %d is outside the target's %d layers", id, n_target_layers);
        }
        if (id == n_target_layers - 1) {
            fail("target layer id %d is the target's last layer, whose rows the fork prunes; not supported", id);
        }
    }
    const int expected = llama_model_n_embd(target) * (int) d.target_ids.size();
    const std::string nf_key = m.prefix + "dflash.n_target_features";
    d.n_target_features = m.has(nf_key) ? (int) m.integer(nf_key, 0) : expected;
    if (d.n_target_features != expected) {
        fail("feature width %d differs from target hidden size %d x %d target layers = %d", d.n_target_features,
             llama_model_n_embd(target), (int) d.target_ids.size(), expected);
    }
}

// The registry's backend whose memory is buft (for a GPU's buffers, that GPU), or null.
ggml_backend_t init_backend_for(ggml_backend_buffer_type_t buft) {
    for (size_t i = 0; i < ggml_backend_reg_get_count(); ++i) {
        if (ggml_backend_reg_get_default_buffer_type(i) == buft) {
            return ggml_backend_reg_init_backend(i, nullptr);
        }
    }
    return nullptr;
}

// The first backend in the registry with memory of its own (the first GPU), or null.
ggml_backend_t init_first_accelerator() {
    for (size_t i = 0; i < ggml_backend_reg_get_count(); ++i) {
        if (!ggml_backend_buft_is_host(ggml_backend_reg_get_default_buffer_type(i))) {
            return ggml_backend_reg_init_backend(i, nullptr);
        }
    }
    return nullptr;
}

// Choose where the draft runs (docs: dflash.h, dflash_draft_params) and set up its schedulers.
void place(dflash_draft & d, const llama_model * target, const dflash_draft_params & params) {
    const ggml_tensor * head = llama_model_output(target) ? llama_model_output(target) : llama_model_token_embd(target);
    ggml_backend_buffer_type_t head_buft = head->buffer ? ggml_backend_buffer_get_type(head->buffer) : nullptr;
    const bool head_on_device = head_buft != nullptr && !ggml_backend_buft_is_host(head_buft);
    if (params.n_gpu_layers < 0 ? head_on_device : params.n_gpu_layers > 0) {
        d.device = head_on_device ? init_backend_for(head_buft) : init_first_accelerator();
        if (d.device == nullptr && head_on_device) {
            const char * where = ggml_backend_buft_name(head_buft);
            if (strncmp(where, "RPC", 3) == 0) {
                fail("the target's output layer is on an RPC worker (%s), but the draft borrows it and runs here: "
                     "offload at most the target's %d layers (-ngl), so the output layer stays local", where,
                     llama_n_layer(target));
            }
            fail("the target's output layer is in %s memory, for which there is no backend to run the draft on", where);
        }
    }
    d.cpu = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(d.cpu, std::max(1, params.n_threads));
    d.buft = ggml_backend_get_default_buffer_type(d.device ? d.device : d.cpu);
    // what the draft borrows from the target must be in memory one of its backends can read
    for (const ggml_tensor * t : {d.tok_embd, d.output}) {
        ggml_backend_buffer_type_t t_buft = t->buffer ? ggml_backend_buffer_get_type(t->buffer) : nullptr;
        if (t_buft != nullptr && !ggml_backend_buft_is_host(t_buft) &&
            (d.device == nullptr || !ggml_backend_supports_buft(d.device, t_buft))) {
            fail("the target's %s is in %s memory, but the draft runs on %s: run the draft where the target keeps "
                 "it (n_gpu_layers for the draft < 0 follows the target) or convert the draft with its own head",
                 ggml_get_name(t), ggml_backend_buft_name(t_buft), ggml_backend_name(d.device ? d.device : d.cpu));
        }
    }
    std::vector<ggml_backend_t> backends;
    if (d.device != nullptr) {
        backends.push_back(d.device);
    }
    backends.push_back(d.cpu);  // the scheduler wants the CPU last
    for (ggml_backend_sched_t * sched : {&d.sched_append, &d.sched_step}) {
        *sched = ggml_backend_sched_new(backends.data(), nullptr, (int) backends.size(), d.graph_nodes, false);
    }
}

void load_weights(dflash_draft & d, gguf_context * gctx) {
    d.buf_w = ggml_backend_alloc_ctx_tensors_from_buft(d.ctx_w, d.buft);
    if (d.buf_w == nullptr) {
        fail("could not allocate memory for the draft's weights");
    }
    std::ifstream file(d.path, std::ios::binary);
    const size_t data_offset = gguf_get_data_offset(gctx);
    std::vector<char> buf;
    for (int i = 0; i < gguf_get_n_tensors(gctx); ++i) {
        ggml_tensor * t = ggml_get_tensor(d.ctx_w, gguf_get_tensor_name(gctx, i));
        // offsets and sizes were checked against the file by check_gguf_layout
        const size_t offset = data_offset + gguf_get_tensor_offset(gctx, i);
        const size_t size = ggml_nbytes(t);
        buf.resize(size);
        file.seekg((std::streamoff) offset);
        if (!file.read(buf.data(), (std::streamsize) size)) {
            fail("cannot read tensor '%s' (%zu bytes at %zu)", ggml_get_name(t), size, offset);
        }
        ggml_backend_tensor_set(t, buf.data(), 0, size);
    }
}

// The selector reads its codebooks on the host, a few rows a step: where the weights live.
void attach_codebooks(dflash_draft & d) {
    for (codebook * cb : {&d.predecessors, &d.successors}) {
        const ggml_tensor * t = cb->tensor;
        if (ggml_backend_buffer_is_host(t->buffer)) {
            cb->data = (const uint8_t *) t->data;
            continue;
        }
        cb->host_copy.resize(ggml_nbytes(t));
        ggml_backend_tensor_get(t, cb->host_copy.data(), 0, cb->host_copy.size());
        cb->data = cb->host_copy.data();
    }
}

// The head cut to head_ids: those rows of the output matrix (and of a DSpark draft's W1 and W2),
// copied as stored into tensors where the draft runs, so each scores exactly what it does whole.
// Copying rows needs a row-major type: a head repacked at load interleaves its rows.
void cut_head(dflash_draft & d) {
    if (!is_matrix_type(d.output->type)) {
        fail("the draft scores %zu of the %d tokens (dflash.head_token_ids), taken from the output matrix, which "
             "is stored as %s, whose rows cannot be taken apart (repacked at load?): load the target without "
             "run-time repacking, or convert the draft without head_token_ids", d.head_ids.size(), d.n_vocab,
             ggml_type_name(d.output->type));
    }
    struct cut { ggml_tensor ** tensor; const ggml_tensor * full; };
    std::vector<cut> cuts = {{&d.output, d.output}};
    if (d.markov_rank > 0) {
        cuts.push_back({&d.markov_prev_scored, d.markov_prev});
        cuts.push_back({&d.markov_bias, d.markov_bias});
    }
    ggml_init_params params = {ggml_tensor_overhead() * cuts.size(), nullptr, /*no_alloc=*/true};
    d.ctx_head = ggml_init(params);
    for (cut & c : cuts) {
        c.tensor[0] = ggml_new_tensor_2d(d.ctx_head, c.full->type, c.full->ne[0], (int64_t) d.head_ids.size());
    }
    d.buf_head = ggml_backend_alloc_ctx_tensors_from_buft(d.ctx_head, d.buft);
    if (d.buf_head == nullptr) {
        fail("could not allocate memory for the draft's head (%zu rows)", d.head_ids.size());
    }
    for (const cut & c : cuts) {
        const size_t row = ggml_row_size(c.full->type, c.full->ne[0]);
        std::vector<uint8_t> rows(row * d.head_ids.size());
        for (size_t i = 0; i < d.head_ids.size(); ++i) {
            ggml_backend_tensor_get(c.full, rows.data() + i * row, (size_t) d.head_ids[i] * c.full->nb[1], row);
        }
        ggml_backend_tensor_set(c.tensor[0], rows.data(), 0, rows.size());
    }
}
}  // namespace

std::unique_ptr<dflash_draft> dflash_impl::load_draft(const char * path, const llama_model * target,
                                                     const dflash_draft_params & params) {
    if (target == nullptr) {
        fail("no target model given");
    }
    if (!std::ifstream(path).good()) {
        fail("%s: file not found", path);
    }
    auto d = std::make_unique<dflash_draft>();
    d->path = path;
    check_gguf_layout(path);
    gguf_init_params gguf_params = {/*no_alloc=*/true, &d->ctx_w};
    gguf_context * gctx = gguf_init_from_file(path, gguf_params);
    if (gctx == nullptr) {
        fail("not a valid GGUF file (bad magic, corrupt or truncated header)");
    }
    std::unique_ptr<gguf_context, decltype(&gguf_free)> gguard(gctx, gguf_free);
    const int arch_id = gguf_find_key(gctx, "general.architecture");
    if (arch_id >= 0 && gguf_get_kv_type(gctx, arch_id) != GGUF_TYPE_STRING) {
        fail("key 'general.architecture' is not a string");
    }
    const std::string arch = arch_id >= 0 ? gguf_get_val_str(gctx, arch_id) : "";
    for (const auto & f : k_formats) {
        if (arch == f.arch) {
            d->format = &f;
        }
    }
    if (d->format == nullptr) {
        fail("architecture '%s' is not a DFlash draft (expected 'dflash-draft' or 'dflash')", arch.c_str());
    }
    gguf_meta meta{gctx, arch + "."};
    read_hparams(*d, meta);
    check_against_target(*d, meta, target);
    bind_tensors(*d, target);

    place(*d, target, params);
    const char * conv_ops = std::getenv("IKDFLASH_DFLASH2_CONV_OPS");
    d->conv_as_ops = conv_ops != nullptr && std::strcmp(conv_ops, "1") == 0;
    load_weights(*d, gctx);
    if (d->is_dflash2()) {
        attach_codebooks(*d);
    }
    if (!d->head_ids.empty()) {
        cut_head(*d);
    }
    d->graph_meta.resize(ggml_tensor_overhead() * d->graph_nodes + ggml_graph_overhead_custom(d->graph_nodes, false));
    return d;
}

// --- C API -----------------------------------------------------------------------------------

const char * dflash_last_error(void) { return dflash_impl::last_error.c_str(); }

bool dflash_last_error_is_argument(void) { return dflash_impl::last_error_is_argument; }

dflash_draft_params dflash_draft_default_params(void) {
    return {/*n_threads=*/(int32_t) std::max(1u, std::thread::hardware_concurrency()), /*n_gpu_layers=*/-1};
}

dflash_draft * dflash_draft_load(const char * path, const llama_model * target, dflash_draft_params params) {
    return guarded([&]() -> dflash_draft * {
        try {
            return dflash_impl::load_draft(path, target, params).release();
        } catch (const dflash_error & e) {
            // name the file once, whatever went wrong
            const std::string what = e.what();
            throw dflash_error(what.rfind(path, 0) == 0 ? what : std::string(path) + ": " + what);
        }
    }, (dflash_draft *) nullptr);
}

void dflash_draft_free(dflash_draft * draft) { delete draft; }

int  dflash_draft_block_size(const dflash_draft * d) { return d->block_size; }
int  dflash_draft_max_proposal(const dflash_draft * d) { return d->max_proposal(); }
bool dflash_draft_dspark_settings(const dflash_draft * d, int32_t out[4]) {
    if (!d->is_dspark()) {
        return false;
    }
    out[0] = d->markov_rank, out[1] = d->confidence_w ? (int32_t) d->confidence_w->ne[0] : 0;
    out[2] = d->anchor_first, out[3] = d->window_from_block;
    return true;
}
int  dflash_draft_mask_token(const dflash_draft * d) { return d->mask_token; }
int  dflash_draft_n_layer(const dflash_draft * d) { return d->n_layer; }
int  dflash_draft_sliding_window(const dflash_draft * d) { return d->window; }
bool dflash_draft_layer_is_sliding(const dflash_draft * d, int il) { return d->sliding.at(il); }
bool dflash_draft_layer_is_causal(const dflash_draft * d, int il) { return d->causal.at(il); }
int  dflash_draft_n_target_layers(const dflash_draft * d) { return (int) d->target_ids.size(); }
int  dflash_draft_target_layer_id(const dflash_draft * d, int i) { return d->target_ids.at(i); }
int  dflash_draft_n_target_features(const dflash_draft * d) { return d->n_target_features; }
const char * dflash_draft_format(const dflash_draft * d) { return d->format->arch; }
int  dflash_draft_n_head_tokens(const dflash_draft * d) { return d->head_ids.empty() ? d->n_vocab : (int) d->head_ids.size(); }
bool dflash_draft_dflash2_settings(const dflash_draft * d, int32_t out[4]) {
    if (!d->is_dflash2()) {
        return false;
    }
    out[0] = d->conv_taps, out[1] = d->conv_group, out[2] = d->selector_rank, out[3] = d->selector_top_k;
    return true;
}
int64_t dflash_draft_n_graph_computes(const dflash_draft * d) { return d->n_graph_computes; }
const char * dflash_draft_device(const dflash_draft * d) { return ggml_backend_name(d->device ? d->device : d->cpu); }
