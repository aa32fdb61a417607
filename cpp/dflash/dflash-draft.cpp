// DFlash draft: loading and checking the GGUF, the cross-context, and the draft step graph.
// The math is docs/dflash.md; names of keys and tensors are docs/gguf.md.

#include "dflash.h"
#include "dflash-measure.h"
#include "dflash-impl.h"
#include "dflash-mask.h"

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

using dflash_impl::check_gguf_layout;
using dflash_impl::dflash_error;
using dflash_impl::fail;
using dflash_impl::guarded;

namespace {

constexpr int k_max_graph_nodes = 8192;  // a DFlash1 step's; a DFlash2 draft adds its convolutions
constexpr int k_conv_nodes_per_tap = 12;
// Bounds on what a draft file may claim, far above any real draft (DFlash drafts have a handful
// of layers and blocks of 16): a step's graph holds k_max_graph_nodes, and sizes multiply.
constexpr int64_t k_max_layers = 64;
constexpr int64_t k_max_block = 256;
constexpr int64_t k_max_width = 1 << 16;   // embedding, ffn, heads x head size
constexpr int64_t k_max_heads = 1024;
constexpr int64_t k_max_target_layers = 256;
constexpr int64_t k_max_conv_taps = 16;
constexpr int k_append_chunk = 256;  // context rows projected per graph
// Keys per attention are padded to a multiple of this (zero rows, hidden by the mask), as the
// fork's own KV cache is: the CPU matrix kernels overrun odd-sized KQ products otherwise.
constexpr int k_kv_pad = 32;

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

// How the two draft formats name things (docs/gguf.md).
struct draft_format {
    const char * arch;
    const char * fc;
    const char * hidden_norm;
    const char * ffn_norm;
    const char * embedding_scale;    // keys after "<arch>."
    const char * output_multiplier;
};
const draft_format k_formats[] = {
    {"dflash-draft", "dflash_fc.weight", "dflash_hidden_norm.weight", "post_attention_norm",
     "dflash.input_embedding_scale", "dflash.output_multiplier"},
    {"dflash",       "fc.weight",        "enc.output_norm.weight",    "ffn_norm",
     "embedding_scale", "logit_scale"},
};

// A DFlash2 layer's in-block convolution around one sublayer: base [n_embd, taps, 2] (stage 0
// before the sublayer, 1 after it) and the projection of a row to its dynamic taps, one per
// channel group and stage.
struct block_conv {
    ggml_tensor * base = nullptr, * proj = nullptr;
};

struct draft_layer {
    ggml_tensor * attn_norm, * ffn_norm;
    ggml_tensor * wq, * wk, * wv, * wo, * q_norm, * k_norm;
    ggml_tensor * ffn_gate, * ffn_up, * ffn_down;
    block_conv attn_conv, ffn_conv;  // DFlash2 only
};

// A DFlash2 selector codebook ([rank, n_vocab]) as the host reads it: one token's row at a time.
struct codebook {
    const ggml_tensor * tensor = nullptr;
    std::vector<uint8_t> host_copy;  // when the tensor lives in an accelerator's memory
    const uint8_t * data = nullptr;

    void row(llama_token id, float * out) const {
        const uint8_t * src = data + (size_t) id * tensor->nb[1];
        if (tensor->type == GGML_TYPE_F32) {
            std::memcpy(out, src, tensor->nb[1]);
        } else {
            ggml_internal_get_type_traits(tensor->type).to_float(src, out, tensor->ne[0]);
        }
    }
};

ggml_tensor * rms_norm(ggml_context * ctx, ggml_tensor * x, ggml_tensor * weight, float eps) {
    return ggml_mul(ctx, ggml_rms_norm(ctx, x, eps), weight);
}

}  // namespace

struct dflash_draft {
    std::string path;
    const draft_format * format = nullptr;

    // hyper-parameters
    int n_layer = 0, n_embd = 0, n_head = 0, n_head_kv = 0, head_dim = 0, n_ff = 0;
    int block_size = 16, mask_token = -1, window = 0, n_ctx_train = 0, n_vocab = 0;
    float rms_eps = 1e-6f, rope_base = 10000.0f;
    float embedding_scale = 1.0f, output_multiplier = 1.0f, logit_softcap = 0.0f;
    std::vector<int> target_ids;
    int n_target_features = 0;
    std::vector<bool> sliding, causal;
    // DFlash2 (docs/dflash.md): in-block convolutions of conv_taps taps over channel groups of
    // conv_group, and the candidate selector re-ranking each row's selector_top_k best tokens
    // by the token chosen before it. conv_taps == 0: a DFlash1 draft.
    int conv_taps = 0, conv_group = 0, selector_rank = 0, selector_top_k = 0;
    bool is_dflash2() const { return conv_taps > 0; }
    bool conv_as_ops = false;  // the convolutions as standard ggml ops on the CPU too (convolve_block)
    int graph_nodes = k_max_graph_nodes;  // a step's graph holds at most this many

    // weights (ours), and the target's embedding and head when the draft has none
    ggml_context * ctx_w = nullptr;
    ggml_backend_buffer_t buf_w = nullptr;
    ggml_tensor * fc = nullptr, * hidden_norm = nullptr, * output_norm = nullptr;
    ggml_tensor * tok_embd = nullptr, * output = nullptr;
    std::vector<draft_layer> layers;
    ggml_tensor * selector_hidden = nullptr;  // [n_embd, rank]
    codebook predecessors, successors;
    // The ids the draft's head scores, increasing, when the file names a subset of the vocabulary
    // (dflash.head_token_ids; empty: all of it). The head is then those rows of the output matrix,
    // copied into a tensor of ours at load: a step reads a fraction of the vocabulary's weights.
    std::vector<llama_token> head_ids;
    ggml_context * ctx_head = nullptr;
    ggml_backend_buffer_t buf_head = nullptr;

    // Where the weights and cross-contexts live: the accelerator's memory when device is set, else
    // the CPU's. The CPU backend always takes part: it computes what reads host memory (the
    // target's token embeddings, usually) and whatever the accelerator cannot.
    ggml_backend_t device = nullptr;
    ggml_backend_t cpu = nullptr;
    ggml_backend_buffer_type_t buft = nullptr;
    // One scheduler per graph kind: an allocator reuses its last plan when a graph has the same
    // node and leaf counts, which two different graphs can have by coincidence.
    ggml_backend_sched_t sched_append = nullptr;
    ggml_backend_sched_t sched_step = nullptr;
    std::vector<uint8_t> graph_meta;

    ~dflash_draft() {
        if (sched_append) ggml_backend_sched_free(sched_append);
        if (sched_step) ggml_backend_sched_free(sched_step);
        if (buf_w) ggml_backend_buffer_free(buf_w);
        if (ctx_w) ggml_free(ctx_w);
        if (buf_head) ggml_backend_buffer_free(buf_head);
        if (ctx_head) ggml_free(ctx_head);
        if (device) ggml_backend_free(device);
        if (cpu) ggml_backend_free(cpu);
    }

    dflash_mask_rule rule(int il, bool full_attention) const {
        const bool is_sliding = sliding[il] && !full_attention;
        return {is_sliding, full_attention ? false : causal[il], window};
    }

    ggml_context * graph_context() {
        ggml_init_params params = {graph_meta.size(), graph_meta.data(), /*no_alloc=*/true};
        return ggml_init(params);
    }

    // Assign gf's nodes to backends and allocate them; inputs can be set after this.
    void allocate(ggml_backend_sched_t sched, ggml_cgraph * gf) {
        ggml_backend_sched_reset(sched);
        if (!ggml_backend_sched_alloc_graph(sched, gf)) {
            fail("could not allocate the draft's compute buffer");
        }
    }

    void compute(ggml_backend_sched_t sched, ggml_cgraph * gf, const char * what) {
        if (ggml_backend_sched_graph_compute(sched, gf) != GGML_STATUS_SUCCESS) {
            fail("computing %s failed", what);
        }
    }
};

struct dflash_cache_layer {
    // F32 rings of capacity slots, then spare rows for a step's block and padding (run_step)
    ggml_tensor * k = nullptr;    // [head_dim * n_head_kv, slots]
    ggml_tensor * v = nullptr;    // [slots, head_dim * n_head_kv]: transposed
    int capacity = 0;
    std::vector<int32_t> slot_pos;  // position held by each slot, -1 for none (never written, or dropped)
    int n_used = 0;                 // rows held
    int n_filled = 0;               // slots [0, n_filled) have been written; attention reads them all
    int next = 0;                   // slot the next row goes to
};

// Every committed context row's fused vector (hidden_norm(fc . f_p), n_embd floats), the newest
// `capacity` of them in position order: the layers' rings are projections of its newest rows, so
// they can be rebuilt exactly after a truncation reaching into rows a ring already overwrote, a
// context shift (rows change positions, their keys change rotation), or a restored state.
struct dflash_history {
    int capacity = 0;
    int n_embd = 0;
    int start = 0;  // ring slot of the oldest row
    int count = 0;
    std::vector<int32_t> pos;
    std::unique_ptr<float[]> rows;  // pages are touched only as rows arrive

    void init(int cap, int width) {
        capacity = cap;
        n_embd = width;
        pos.assign(cap, -1);
        rows.reset(new float[(size_t) cap * width]);
    }
    int slot(int i) const { return (start + i) % capacity; }  // i = 0 is the oldest row
    int32_t pos_at(int i) const { return pos[slot(i)]; }
    const float * row_at(int i) const { return rows.get() + (size_t) slot(i) * n_embd; }

    void push(const float * row, int32_t p) {
        if (count == capacity) {
            start = (start + 1) % capacity;
            --count;
        }
        pos[slot(count)] = p;
        std::copy(row, row + n_embd, rows.get() + (size_t) slot(count) * n_embd);
        ++count;
    }
    void drop_from(int32_t p) {
        while (count > 0 && pos_at(count - 1) >= p) {
            --count;
        }
    }
};

struct dflash_cache {
    dflash_draft * draft = nullptr;
    int cross_ctx = 0;
    bool full_attention = false;
    int32_t last_pos = -1;  // of the newest row appended, pending or not
    // Rows appended but not yet projected (feature rows, n_target_features floats each). They are
    // projected as one batch when the draft next steps or the cache is read: decoding without
    // drafting (the adaptive block length at k = 0) then builds one graph per probe, not one per
    // token, and each row costs a quarter as much.
    std::vector<float> pending_features;
    std::vector<int32_t> pending_pos;
    ggml_context * ctx = nullptr;
    ggml_backend_buffer_t buf = nullptr;
    std::vector<dflash_cache_layer> layers;
    dflash_history history;
    bool stale = false;  // a ring lacks rows the history has: rebuilt before the next append or step

    ~dflash_cache() {
        if (buf) ggml_backend_buffer_free(buf);
        if (ctx) ggml_free(ctx);
    }

    int n_pending() const { return (int) pending_pos.size(); }
    void keep_pending(int n) {  // the oldest n pending rows stay
        pending_pos.resize(n);
        pending_features.resize((size_t) n * draft->n_target_features);
    }

    void clear_rings() {
        for (auto & cl : layers) {
            cl.n_used = cl.n_filled = cl.next = 0;
            std::fill(cl.slot_pos.begin(), cl.slot_pos.end(), -1);
        }
    }
};

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

// The head cut to head_ids: those rows of the output matrix, copied as stored into a tensor where
// the draft runs, so each scores exactly what it does in the whole head. Copying rows needs a
// row-major type: a head repacked at load interleaves its rows.
void cut_head(dflash_draft & d) {
    const ggml_tensor * full = d.output;
    if (!is_matrix_type(full->type)) {
        fail("the draft scores %zu of the %d tokens (dflash.head_token_ids), taken from the output matrix, which "
             "is stored as %s, whose rows cannot be taken apart (repacked at load?): load the target without "
             "run-time repacking, or convert the draft without head_token_ids", d.head_ids.size(), d.n_vocab,
             ggml_type_name(full->type));
    }
    ggml_init_params params = {ggml_tensor_overhead(), nullptr, /*no_alloc=*/true};
    d.ctx_head = ggml_init(params);
    ggml_tensor * head = ggml_new_tensor_2d(d.ctx_head, full->type, full->ne[0], (int64_t) d.head_ids.size());
    ggml_set_name(head, "dflash_head");
    d.buf_head = ggml_backend_alloc_ctx_tensors_from_buft(d.ctx_head, d.buft);
    if (d.buf_head == nullptr) {
        fail("could not allocate memory for the draft's head (%zu rows)", d.head_ids.size());
    }
    const size_t row = ggml_row_size(full->type, full->ne[0]);
    std::vector<uint8_t> rows(row * d.head_ids.size());
    for (size_t i = 0; i < d.head_ids.size(); ++i) {
        ggml_backend_tensor_get(full, rows.data() + i * row, (size_t) d.head_ids[i] * full->nb[1], row);
    }
    ggml_backend_tensor_set(head, rows.data(), 0, rows.size());
    d.output = head;
}

std::unique_ptr<dflash_draft> load(const char * path, const llama_model * target, const dflash_draft_params & params) {
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

// --- graphs ----------------------------------------------------------------------------------

ggml_tensor * rope(const dflash_draft & d, ggml_context * ctx, ggml_tensor * x, ggml_tensor * pos) {
    return ggml_rope_ext(ctx, x, pos, nullptr, d.head_dim, GGML_ROPE_TYPE_NEOX, d.n_ctx_train, d.rope_base, 1.0f,
                         0.0f, 1.0f, 0.0f, 0.0f);
}

// Keys and values of rows x ([n_embd, n]) at positions pos, for layer il: K normed and rotated.
void project_kv(const dflash_draft & d, ggml_context * ctx, int il, ggml_tensor * x, ggml_tensor * pos,
                ggml_tensor ** k, ggml_tensor ** v) {
    const draft_layer & l = d.layers[il];
    const int64_t n = x->ne[1];
    *k = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, l.wk, x), d.head_dim, d.n_head_kv, n);
    *k = rope(d, ctx, rms_norm(ctx, *k, l.k_norm, d.rms_eps), pos);
    *v = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, l.wv, x), d.head_dim, d.n_head_kv, n);
}

// Projected keys or values ([head_dim, n_head_kv, n]) as n rows of head_dim * n_head_kv.
ggml_tensor * kv_rows(ggml_context * ctx, ggml_tensor * t) {
    ggml_tensor * rows = ggml_is_contiguous(t) ? t : ggml_cont(ctx, t);
    return ggml_reshape_2d(ctx, rows, t->ne[0] * t->ne[1], t->ne[2]);
}

// Copy the n columns of src ([row, n]) into a layer's ring slots [slot, slot + n): keys are
// stored a slot per column ([row, slots]), values transposed ([slots, row]), the layout the
// attention's value product reads without a copy.
void write_slots(ggml_context * ctx, ggml_cgraph * gf, ggml_tensor * src, ggml_tensor * ring, bool transposed, int slot) {
    const int64_t n = src->ne[1];
    ggml_tensor * to = transposed ? ggml_view_2d(ctx, ring, n, ring->ne[1], ring->nb[1], slot * ring->nb[0])
                                  : ggml_view_2d(ctx, ring, ring->ne[0], n, ring->nb[1], slot * ring->nb[1]);
    // a permutation, not ggml_transpose: the CPU copy of a GGML_OP_TRANSPOSE source writes its
    // destination as if contiguous
    ggml_build_forward_expand(gf, ggml_cpy(ctx, transposed ? ggml_permute(ctx, src, 1, 0, 2, 3) : src, to));
}

// The same into ring slots starting at slot, wrapping at capacity.
void write_ring(ggml_context * ctx, ggml_cgraph * gf, ggml_tensor * src, ggml_tensor * ring, bool transposed,
                int capacity, int slot) {
    const int64_t n = src->ne[1];
    int64_t done = 0;
    while (done < n) {
        const int64_t run = std::min<int64_t>(n - done, capacity - slot);
        write_slots(ctx, gf, ggml_view_2d(ctx, src, src->ne[0], run, src->nb[1], done * src->nb[1]), ring, transposed, slot);
        done += run;
        slot = 0;
    }
}

// Project n context rows into the layers' rings. Each layer projects only the rows its ring will
// keep: n_after rows still follow in the same append. in: feature rows (n_target_features floats
// each) when fuse, else fused rows (n_embd each); fused_out (may be null) receives the fused rows.
void append_rows(dflash_draft & d, dflash_cache & c, const float * in, bool fuse, const int32_t * pos, int n,
                 int n_after, float * fused_out) {
    ggml_context * ctx = d.graph_context();
    std::unique_ptr<ggml_context, decltype(&ggml_free)> guard(ctx, ggml_free);
    ggml_cgraph * gf = ggml_new_graph_custom(ctx, d.graph_nodes, false);
    ggml_tensor * inp = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, fuse ? d.n_target_features : d.n_embd, n);
    ggml_tensor * inp_pos = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n);
    ggml_set_input(inp);
    ggml_set_input(inp_pos);
    // context row: c_p = hidden_norm(fc . f_p), shared by every layer
    ggml_tensor * rows = fuse ? rms_norm(ctx, ggml_mul_mat(ctx, d.fc, inp), d.hidden_norm, d.rms_eps) : inp;
    if (fused_out != nullptr) {
        ggml_set_output(rows);
        ggml_build_forward_expand(gf, rows);
    }

    struct pending { int il, first, count, slot; };
    std::vector<pending> updates;
    for (int il = 0; il < d.n_layer; ++il) {
        dflash_cache_layer & cl = c.layers[il];
        // older rows would be overwritten before this append ends
        const int keep = std::clamp(cl.capacity - n_after, 0, n);
        if (keep == 0) {
            continue;
        }
        const int first = n - keep;
        ggml_tensor * x = ggml_view_2d(ctx, rows, d.n_embd, keep, rows->nb[1], first * rows->nb[1]);
        ggml_tensor * p = ggml_view_1d(ctx, inp_pos, keep, first * sizeof(int32_t));
        ggml_tensor * k, * v;
        project_kv(d, ctx, il, x, p, &k, &v);
        const int slot = (cl.next + (n - keep)) % cl.capacity;
        write_ring(ctx, gf, kv_rows(ctx, k), cl.k, false, cl.capacity, slot);
        write_ring(ctx, gf, kv_rows(ctx, v), cl.v, true, cl.capacity, slot);
        updates.push_back({il, first, keep, slot});
    }
    if (updates.empty() && fused_out == nullptr) {
        return;
    }
    d.allocate(d.sched_append, gf);
    ggml_backend_tensor_set(inp, in, 0, ggml_nbytes(inp));
    if (!updates.empty()) {  // positions are only read by the projections
        ggml_backend_tensor_set(inp_pos, pos, 0, ggml_nbytes(inp_pos));
    }
    d.compute(d.sched_append, gf, "the context rows");
    if (fused_out != nullptr) {
        ggml_backend_tensor_get(rows, fused_out, 0, ggml_nbytes(rows));
    }
    for (int il = 0; il < d.n_layer; ++il) {
        dflash_cache_layer & cl = c.layers[il];
        if (cl.capacity > 0) {
            cl.next = (cl.next + n) % cl.capacity;
            cl.n_used = std::min(cl.capacity, cl.n_used + n);
        }
    }
    for (const pending & u : updates) {
        dflash_cache_layer & cl = c.layers[u.il];
        for (int i = 0; i < u.count; ++i) {
            cl.slot_pos[(u.slot + i) % cl.capacity] = pos[u.first + i];
        }
        // slots past n_filled were never written: a write after a truncation can stay below it
        cl.n_filled = u.slot + u.count > cl.capacity ? cl.capacity : std::max(cl.n_filled, u.slot + u.count);
    }
}

// Rebuild every ring from the history's newest rows (see dflash_history).
void rebuild_rings(dflash_draft & d, dflash_cache & c) {
    c.clear_rings();
    const dflash_history & h = c.history;
    int max_capacity = 0;
    for (const auto & cl : c.layers) {
        max_capacity = std::max(max_capacity, cl.capacity);
    }
    const int first = h.count - std::min(h.count, max_capacity);
    std::vector<float> rows;
    std::vector<int32_t> pos;
    for (int i = first; i < h.count; i += k_append_chunk) {
        const int n = std::min(k_append_chunk, h.count - i);
        rows.resize((size_t) n * h.n_embd);
        pos.resize(n);
        for (int j = 0; j < n; ++j) {
            std::copy(h.row_at(i + j), h.row_at(i + j) + h.n_embd, rows.data() + (size_t) j * h.n_embd);
            pos[j] = h.pos_at(i + j);
        }
        append_rows(d, c, rows.data(), false, pos.data(), n, h.count - i - n, nullptr);
    }
    c.stale = false;
}

// Project the pending rows into the rings and the history (see dflash_cache::pending_features).
void flush_pending(dflash_draft & d, dflash_cache & c) {
    if (c.stale) {
        rebuild_rings(d, c);
    }
    const int n_rows = c.n_pending();
    // rows older than the history's capacity would leave it (and every ring) within this append
    const int first = std::max(0, n_rows - c.history.capacity);
    std::vector<float> fused;
    for (int i = first; i < n_rows; i += k_append_chunk) {
        const int n = std::min(k_append_chunk, n_rows - i);
        fused.resize((size_t) n * d.n_embd);
        append_rows(d, c, c.pending_features.data() + (size_t) i * d.n_target_features, true,
                    c.pending_pos.data() + i, n, n_rows - i - n, fused.data());
        for (int j = 0; j < n; ++j) {
            c.history.push(fused.data() + (size_t) j * d.n_embd, c.pending_pos[i + j]);
        }
    }
    c.keep_pending(0);
}

int n_scored(const dflash_draft & d) { return d.head_ids.empty() ? d.n_vocab : (int) d.head_ids.size(); }

// The step's logits as the head scores them: n_rows x n_scored floats.
std::vector<float> read_scored(const dflash_draft & d, ggml_tensor * logits, int n_rows) {
    std::vector<float> scored((size_t) n_rows * n_scored(d));
    ggml_backend_tensor_get(logits, scored.data(), 0, ggml_nbytes(logits));
    return scored;
}

// The scored logits over the whole vocabulary, n_rows x n_vocab floats: a cut head leaves the ids
// it does not score at -inf.
void expand_logits(const dflash_draft & d, const std::vector<float> & scored, int n_rows, float * out) {
    if (d.head_ids.empty()) {
        std::copy(scored.begin(), scored.end(), out);
        return;
    }
    const size_t n_ids = d.head_ids.size();
    std::fill(out, out + (size_t) n_rows * d.n_vocab, -INFINITY);
    for (int r = 0; r < n_rows; ++r) {
        for (size_t i = 0; i < n_ids; ++i) {
            out[(size_t) r * d.n_vocab + d.head_ids[i]] = scored[r * n_ids + i];
        }
    }
}

// The k ids with the highest logits into best, highest first, lower ids first among equal ones;
// NaN never, and id 0 when every logit is NaN. One pass, most ids rejected by one comparison: a
// sort of the head's thousands of ids cost more than the rest of the selector.
void best_scored(const float * logit, int n_ids, int k, std::vector<int32_t> & best) {
    best.clear();
    for (int32_t i = 0; i < n_ids; ++i) {
        const float v = logit[i];
        if (std::isnan(v) || ((int) best.size() == k && !(v > logit[best.back()]))) {
            continue;
        }
        const auto at = std::upper_bound(best.begin(), best.end(), v, [logit](float x, int32_t j) { return x > logit[j]; });
        if ((int) best.size() == k) {
            best.pop_back();
        }
        best.insert(at, i);
    }
    if (best.empty()) {
        best.push_back(0);
    }
}

// DFlash2's candidate selector, greedy. Left to right over the head rows from max(1, head_row0),
// each row's token is the best of its selector_top_k highest-scored ids by
// logit + <predecessor[previous] * hidden_projection(row), successor[candidate]>, previous being
// the token chosen for the row before (the block's first token for row 1). scored: the head
// rows' logits (read_scored); projected: their hidden projections, selector_rank floats a row.
void select_tokens(const dflash_draft & d, const std::vector<float> & scored, const std::vector<float> & projected,
                   int head_row0, int n_head, llama_token first, llama_token * tokens_out) {
    const int n_ids = n_scored(d), rank = d.selector_rank;
    const int k = std::min(d.selector_top_k, n_ids);
    std::vector<int32_t> order;
    std::vector<float> query(rank), successor(rank);
    llama_token previous = first;
    for (int j = std::max(1, head_row0); j < head_row0 + n_head; ++j) {
        const float * logit = scored.data() + (size_t) (j - head_row0) * n_ids;
        const float * hidden = projected.data() + (size_t) (j - head_row0) * rank;
        best_scored(logit, n_ids, k, order);
        d.predecessors.row(previous, query.data());
        for (int r = 0; r < rank; ++r) {
            query[r] *= hidden[r];
        }
        float best_score = -INFINITY;
        llama_token best = d.head_ids.empty() ? order[0] : d.head_ids[order[0]];
        for (int i = 0; i < (int) order.size(); ++i) {
            const llama_token id = d.head_ids.empty() ? order[i] : d.head_ids[order[i]];
            d.successors.row(id, successor.data());
            float score = 0.0f;
            for (int r = 0; r < rank; ++r) {
                score += query[r] * successor[r];
            }
            score += logit[order[i]];
            if (score > best_score) {
                best_score = score;
                best = id;
            }
        }
        tokens_out[j - 1] = previous = best;
    }
}

// A DFlash2 layer's in-block convolution, stage 0 (on the sublayer's normed input) or 1 (on its
// output): row t of the result is the sum over taps j of (base[stage][j] + dynamic taps of row t
// for stage, j and the channel's group) * in[t - j], rows before the block counting as zeros.
// taps: [2 * conv_taps * groups, B], the projection of the sublayer's normed input. Each tap is
// added where the reference adds it (base, then dynamic), so the sums round alike.
//
// As standard ggml ops (any backend) this is ~7 nodes per tap; on 2 CPU threads a node costs a
// few microseconds whatever its size, more than the arithmetic. So where the draft runs on the
// CPU the whole convolution is one node (convolve_rows), computing the same sums in the same
// order. IKDFLASH_DFLASH2_CONV_OPS=1 takes the standard ops on the CPU too.
ggml_tensor * convolve_block_ops(const dflash_draft & d, ggml_context * ctx, ggml_tensor * in, ggml_tensor * taps,
                                 const block_conv & conv, int stage) {
    const int64_t B = in->ne[1], groups = d.n_embd / d.conv_group;
    ggml_tensor * out = nullptr;
    for (int j = 0; j < d.conv_taps && j < B; ++j) {
        const int64_t n = B - j;  // rows j.. of the result read rows ..n-1 of in
        ggml_tensor * src = ggml_view_2d(ctx, in, d.n_embd, n, in->nb[1], 0);
        ggml_tensor * base = ggml_view_1d(ctx, conv.base, d.n_embd, stage * conv.base->nb[2] + j * conv.base->nb[1]);
        ggml_tensor * dynamic = ggml_view_3d(ctx, taps, 1, groups, n, taps->nb[0], taps->nb[1],
                                             (stage * d.conv_taps + j) * groups * taps->nb[0] + j * taps->nb[1]);
        ggml_tensor * by_base = ggml_mul(ctx, src, base);
        ggml_tensor * by_dynamic = ggml_reshape_2d(ctx, ggml_mul(ctx, ggml_reshape_3d(ctx, src, d.conv_group, groups, n),
                                                                 dynamic), d.n_embd, n);
        if (j == 0) {
            out = ggml_add(ctx, by_base, by_dynamic);
        } else {
            const size_t offset = j * out->nb[1];
            out = ggml_acc(ctx, out, by_base, out->nb[1], out->nb[2], out->nb[3], offset);
            out = ggml_acc(ctx, out, by_dynamic, out->nb[1], out->nb[2], out->nb[3], offset);
        }
    }
    return out;
}

// convolve_block's sums on the host, one node. in: [n_embd, B] f32; taps: the stage's dynamic
// taps, [conv_taps * groups, B] (a view of the projection); base: the stage's [n_embd, conv_taps].
// Threads share the rows. Rows before the block are zeros, and their terms are added as the
// reference adds them (a NaN or infinite tap spreads alike).
void convolve_rows(ggml_tensor * dst, const ggml_tensor * in, const ggml_tensor * taps, const ggml_tensor * base,
                   int ith, int nth, void * /*userdata*/) {
    const int64_t n_embd = in->ne[0], B = in->ne[1], n_taps = base->ne[1];
    const int64_t groups = taps->ne[0] / n_taps, group = n_embd / groups;
    for (int64_t t = ith; t < B; t += nth) {
        float * out = (float *) ((char *) dst->data + t * dst->nb[1]);
        const float * dynamic = (const float *) ((const char *) taps->data + t * taps->nb[1]);
        for (int64_t c = 0; c < n_embd; ++c) {
            out[c] = 0.0f;
        }
        for (int64_t j = 0; j < n_taps; ++j) {
            const float * kernel = (const float *) ((const char *) base->data + j * base->nb[1]);
            const float * x = t >= j ? (const float *) ((const char *) in->data + (t - j) * in->nb[1]) : nullptr;
            for (int64_t g = 0; g < groups; ++g) {
                const float tap = dynamic[j * groups + g];
                for (int64_t c = g * group; c < (g + 1) * group; ++c) {
                    const float v = x ? x[c] : 0.0f;
                    const float by_base = kernel[c] * v, by_dynamic = tap * v;
                    out[c] = j == 0 ? by_base + by_dynamic : (out[c] + by_base) + by_dynamic;
                }
            }
        }
    }
}

ggml_tensor * convolve_block(const dflash_draft & d, ggml_context * ctx, ggml_tensor * in, ggml_tensor * taps,
                             const block_conv & conv, int stage) {
    if (d.device != nullptr || d.conv_as_ops) {
        return convolve_block_ops(d, ctx, in, taps, conv, stage);
    }
    const int64_t per_stage = (int64_t) d.conv_taps * (d.n_embd / d.conv_group);
    ggml_tensor * stage_taps = ggml_view_2d(ctx, taps, per_stage, taps->ne[1], taps->nb[1], stage * per_stage * taps->nb[0]);
    ggml_tensor * base = ggml_view_2d(ctx, conv.base, d.n_embd, d.conv_taps, conv.base->nb[1], stage * conv.base->nb[2]);
    return ggml_map_custom3(ctx, in, stage_taps, base, convolve_rows, GGML_N_TASKS_MAX, nullptr);
}

// One draft step. The head, which costs more than the layers for a large vocabulary, runs only on
// block rows head_row0 .. head_row0 + n_head - 1. The layers run the whole block where a layer
// attends both ways within it; where every layer is causal, a row sees no row after it, so the
// rows past the last head row are left out. The first-maximum argmax of every head row past row
// 0 goes to tokens_out; the logits leave the backend only when logits_out asks for them
// (sampling): greedy steps read n_head ids, not n_head x n_vocab floats from a GPU.
void run_step(dflash_draft & d, dflash_cache & c, llama_token first, int32_t start, int head_row0, int n_head,
              float * logits_out, llama_token * tokens_out) {
    bool all_causal = true;
    for (int il = 0; il < d.n_layer; ++il) {
        all_causal = all_causal && d.rule(il, c.full_attention).causal;
    }
    const int B = all_causal ? head_row0 + n_head : d.block_size;  // block rows computed
    ggml_context * ctx = d.graph_context();
    std::unique_ptr<ggml_context, decltype(&ggml_free)> guard(ctx, ggml_free);
    ggml_cgraph * gf = ggml_new_graph_custom(ctx, d.graph_nodes, false);

    ggml_tensor * inp_tokens = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, B);
    ggml_tensor * inp_pos = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, B);
    ggml_set_input(inp_tokens);
    ggml_set_input(inp_pos);
    std::vector<ggml_tensor *> masks(d.n_layer);
    for (int il = 0; il < d.n_layer; ++il) {
        masks[il] = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, dflash_mask_cols(c.layers[il].n_filled + B, k_kv_pad),
                                       dflash_mask_rows(B));
        ggml_set_input(masks[il]);
    }

    // the block [t, m, ..., m]: the target's embedding rows, times the checkpoint's scale
    ggml_tensor * x = ggml_get_rows(ctx, d.tok_embd, inp_tokens);
    if (d.embedding_scale != 1.0f) {
        x = ggml_scale(ctx, x, d.embedding_scale);
    }
    const float kq_scale = 1.0f / std::sqrt((float) d.head_dim);
    for (int il = 0; il < d.n_layer; ++il) {
        const draft_layer & l = d.layers[il];
        const dflash_cache_layer & cl = c.layers[il];
        ggml_tensor * a = rms_norm(ctx, x, l.attn_norm, d.rms_eps);
        ggml_tensor * attn_taps = nullptr;
        if (d.is_dflash2()) {
            attn_taps = ggml_mul_mat(ctx, l.attn_conv.proj, a);
            a = convolve_block(d, ctx, a, attn_taps, l.attn_conv, 0);
        }
        ggml_tensor * q = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, l.wq, a), d.head_dim, d.n_head, B);
        q = rope(d, ctx, rms_norm(ctx, q, l.q_norm, d.rms_eps), inp_pos);
        ggml_tensor * k_block, * v_block;
        project_kv(d, ctx, il, a, inp_pos, &k_block, &v_block);
        // keys: the retained context rows (ring order; the mask knows their positions), then the
        // block, then padding. The block's rows are written to the spare rows right after the
        // retained ones (they are expanded first, so computed before the attention reads them),
        // so one view of the ring serves without copying the context each step; the padding
        // rows hold zeros or an earlier step's block, both finite and masked.
        const int n_keys = dflash_mask_cols(cl.n_filled + B, k_kv_pad);
        write_slots(ctx, gf, kv_rows(ctx, k_block), cl.k, false, cl.n_filled);
        write_slots(ctx, gf, kv_rows(ctx, v_block), cl.v, true, cl.n_filled);
        ggml_tensor * k = ggml_view_3d(ctx, cl.k, d.head_dim, d.n_head_kv, n_keys, cl.k->nb[1] / d.n_head_kv, cl.k->nb[1], 0);
        // [n_keys, head_dim, n_head_kv]: each value feature's row of slots
        ggml_tensor * v_t = ggml_view_3d(ctx, cl.v, n_keys, d.head_dim, d.n_head_kv, cl.v->nb[1], cl.v->nb[1] * d.head_dim, 0);
        // attention per head: grouped-query broadcast of kv heads over query heads
        ggml_tensor * kq = ggml_mul_mat(ctx, ggml_permute(ctx, k, 0, 2, 1, 3), ggml_permute(ctx, q, 0, 2, 1, 3));
        kq = ggml_soft_max_ext(ctx, kq, masks[il], kq_scale, 0.0f);
        ggml_tensor * kqv = ggml_mul_mat(ctx, v_t, kq);  // [head_dim, B, n_head]
        ggml_tensor * attn = ggml_cont_2d(ctx, ggml_permute(ctx, kqv, 0, 2, 1, 3), d.head_dim * d.n_head, B);
        ggml_tensor * attn_out = ggml_mul_mat(ctx, l.wo, attn);
        if (d.is_dflash2()) {
            attn_out = convolve_block(d, ctx, attn_out, attn_taps, l.attn_conv, 1);
        }
        x = ggml_add(ctx, x, attn_out);

        ggml_tensor * n = rms_norm(ctx, x, l.ffn_norm, d.rms_eps);
        ggml_tensor * ffn_taps = nullptr;
        if (d.is_dflash2()) {
            ffn_taps = ggml_mul_mat(ctx, l.ffn_conv.proj, n);
            n = convolve_block(d, ctx, n, ffn_taps, l.ffn_conv, 0);
        }
        ggml_tensor * ff = ggml_mul(ctx, ggml_silu(ctx, ggml_mul_mat(ctx, l.ffn_gate, n)), ggml_mul_mat(ctx, l.ffn_up, n));
        ggml_tensor * ff_out = ggml_mul_mat(ctx, l.ffn_down, ff);
        if (d.is_dflash2()) {
            ff_out = convolve_block(d, ctx, ff_out, ffn_taps, l.ffn_conv, 1);
        }
        x = ggml_add(ctx, x, ff_out);
    }
    x = ggml_view_2d(ctx, x, d.n_embd, n_head, x->nb[1], (size_t) head_row0 * x->nb[1]);
    x = rms_norm(ctx, x, d.output_norm, d.rms_eps);
    ggml_tensor * logits = ggml_mul_mat(ctx, d.output, x);
    if (d.output_multiplier != 1.0f) {
        logits = ggml_scale(ctx, logits, d.output_multiplier);
    }
    if (d.logit_softcap > 0.0f) {
        logits = ggml_scale(ctx, ggml_tanh(ctx, ggml_scale(ctx, logits, 1.0f / d.logit_softcap)), d.logit_softcap);
    }
    // DFlash1: the argmax on the backend. DFlash2: the logits and the rows' hidden projections
    // go to the host's selector.
    ggml_tensor * ids = nullptr, * projected = nullptr;
    if (d.is_dflash2()) {
        projected = ggml_mul_mat(ctx, d.selector_hidden, x);
        ggml_set_output(projected);
        ggml_build_forward_expand(gf, projected);
    } else {
        ids = ggml_argmax(ctx, logits);
        ggml_set_output(ids);
        ggml_build_forward_expand(gf, ids);
    }
    if (logits_out || d.is_dflash2()) {
        ggml_set_output(logits);
        ggml_build_forward_expand(gf, logits);
    }
    d.allocate(d.sched_step, gf);

    std::vector<llama_token> block(B, d.mask_token);
    block[0] = first;
    std::vector<int32_t> positions(B);
    for (int j = 0; j < B; ++j) {
        positions[j] = start + j;
    }
    ggml_backend_tensor_set(inp_tokens, block.data(), 0, ggml_nbytes(inp_tokens));
    ggml_backend_tensor_set(inp_pos, positions.data(), 0, ggml_nbytes(inp_pos));
    std::vector<ggml_fp16_t> mask;
    for (int il = 0; il < d.n_layer; ++il) {
        const dflash_cache_layer & cl = c.layers[il];
        mask.resize(ggml_nelements(masks[il]));
        dflash_fill_mask(mask.data(), d.rule(il, c.full_attention), cl.slot_pos.data(), cl.n_filled, start, B, k_kv_pad);
        ggml_backend_tensor_set(masks[il], mask.data(), 0, ggml_nbytes(masks[il]));
    }
    d.compute(d.sched_step, gf, "the draft step");
    std::vector<float> scored;
    if (logits_out || d.is_dflash2()) {
        scored = read_scored(d, logits, n_head);
    }
    if (logits_out) {
        expand_logits(d, scored, n_head, logits_out);
    }
    if (d.is_dflash2()) {
        std::vector<float> hidden((size_t) n_head * d.selector_rank);
        ggml_backend_tensor_get(projected, hidden.data(), 0, ggml_nbytes(projected));
        select_tokens(d, scored, hidden, head_row0, n_head, first, tokens_out);
        return;
    }
    std::vector<int32_t> best(n_head);
    ggml_backend_tensor_get(ids, best.data(), 0, ggml_nbytes(ids));
    for (int j = std::max(1, head_row0); j < head_row0 + n_head; ++j) {
        const int32_t i = best[j - head_row0];
        tokens_out[j - 1] = d.head_ids.empty() ? i : d.head_ids[i];
    }
}

}  // namespace

// --- C API -----------------------------------------------------------------------------------

const char * dflash_last_error(void) { return dflash_impl::last_error.c_str(); }

bool dflash_last_error_is_argument(void) { return dflash_impl::last_error_is_argument; }

dflash_draft_params dflash_draft_default_params(void) {
    return {/*n_threads=*/(int32_t) std::max(1u, std::thread::hardware_concurrency()), /*n_gpu_layers=*/-1};
}

dflash_draft * dflash_draft_load(const char * path, const llama_model * target, dflash_draft_params params) {
    return guarded([&]() -> dflash_draft * {
        try {
            return load(path, target, params).release();
        } catch (const dflash_error & e) {
            // name the file once, whatever went wrong
            const std::string what = e.what();
            throw dflash_error(what.rfind(path, 0) == 0 ? what : std::string(path) + ": " + what);
        }
    }, (dflash_draft *) nullptr);
}

void dflash_draft_free(dflash_draft * draft) { delete draft; }

int  dflash_draft_block_size(const dflash_draft * d) { return d->block_size; }
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
const char * dflash_draft_device(const dflash_draft * d) { return ggml_backend_name(d->device ? d->device : d->cpu); }

dflash_cache * dflash_cache_init(dflash_draft * d, int cross_ctx, bool full_attention) {
    return guarded([&]() -> dflash_cache * {
        if (cross_ctx < 1) {
            fail("cross_ctx must be at least 1, got %d", cross_ctx);
        }
        auto c = std::make_unique<dflash_cache>();
        c->draft = d;
        c->cross_ctx = cross_ctx;
        c->full_attention = full_attention;
        ggml_init_params params = {ggml_tensor_overhead() * 2 * d->n_layer, nullptr, /*no_alloc=*/true};
        c->ctx = ggml_init(params);
        const int kv_dim = d->head_dim * d->n_head_kv;
        for (int il = 0; il < d->n_layer; ++il) {
            dflash_cache_layer cl;
            // block row 0 is the oldest query: it sees window - 1 context rows at most
            const bool sliding = d->rule(il, full_attention).sliding;
            cl.capacity = sliding ? std::min(cross_ctx, std::max(0, d->window - 1)) : cross_ctx;
            // spare rows after the ring: a step's block and the padding (see run_step)
            const int rows = cl.capacity + d->block_size + k_kv_pad;
            cl.k = ggml_new_tensor_2d(c->ctx, GGML_TYPE_F32, kv_dim, rows);
            cl.v = ggml_new_tensor_2d(c->ctx, GGML_TYPE_F32, rows, kv_dim);  // transposed (write_slots)
            cl.slot_pos.assign(cl.capacity, -1);
            c->layers.push_back(std::move(cl));
        }
        // every layer's ring holds at most cross_ctx rows: the history keeps as many
        c->history.init(cross_ctx, d->n_embd);
        c->buf = ggml_backend_alloc_ctx_tensors_from_buft(c->ctx, d->buft);
        if (c->buf == nullptr) {
            fail("could not allocate the cross-context (%d rows)", cross_ctx);
        }
        ggml_backend_buffer_clear(c->buf, 0);  // masked keys' values still meet a probability of 0: never NaN
        return c.release();
    }, (dflash_cache *) nullptr);
}

void dflash_cache_free(dflash_cache * c) { delete c; }

void dflash_cache_clear(dflash_cache * c) {
    c->keep_pending(0);
    c->clear_rings();
    c->history.count = c->history.start = 0;
    c->stale = false;
    c->last_pos = -1;
}

void dflash_cache_truncate(dflash_cache * c, int32_t pos) {
    int keep = c->n_pending();
    while (keep > 0 && c->pending_pos[keep - 1] >= pos) {
        --keep;
    }
    c->keep_pending(keep);
    c->history.drop_from(pos);
    for (auto & cl : c->layers) {
        // rows arrive in increasing positions, so the rows to drop are the newest ones
        while (cl.n_used > 0) {
            const int newest = (cl.next + cl.capacity - 1) % cl.capacity;
            if (cl.slot_pos[newest] < pos) {
                break;
            }
            cl.slot_pos[newest] = -1;  // hidden by the mask until a new row overwrites it
            cl.next = newest;
            --cl.n_used;
        }
        // a ring that had wrapped lost older rows its window still needs: the history has them
        c->stale = c->stale || cl.n_used < std::min(cl.capacity, c->history.count);
    }
    c->last_pos = std::min(c->last_pos, pos - 1);
}

int dflash_cache_shift(dflash_cache * c, int32_t p0, int32_t p1, int32_t delta) {
    return guarded([&]() -> int {
        if (p0 < 0 || p1 < p0 || (delta < 0 && p1 + delta < p0)) {
            fail("cannot shift: drop [%d, %d) and move the rows after it by %d", p0, p1, delta);
        }
        flush_pending(*c->draft, *c);
        dflash_history & h = c->history;
        std::vector<int32_t> pos;
        std::vector<float> rows;
        for (int i = 0; i < h.count; ++i) {
            const int32_t p = h.pos_at(i);
            if (p >= p0 && p < p1) {
                continue;
            }
            pos.push_back(p >= p1 ? p + delta : p);
            rows.insert(rows.end(), h.row_at(i), h.row_at(i) + h.n_embd);
        }
        h.start = h.count = 0;
        for (size_t i = 0; i < pos.size(); ++i) {
            h.push(rows.data() + i * h.n_embd, pos[i]);
        }
        c->last_pos = c->last_pos >= p1 ? c->last_pos + delta : std::min(c->last_pos, p0 - 1);
        c->stale = true;
        return 0;
    }, -1);
}

namespace {
constexpr uint32_t k_state_magic = 0x53434644;  // "DFCS": a DFlash cross-context state
constexpr uint32_t k_state_version = 1;

struct state_header {
    uint32_t magic, version;
    int32_t n_embd, count, last_pos;
};
}  // namespace

// Rows still pending are projected first: the state holds fused rows only. 0 when that fails.
static bool flush_for_reading(dflash_cache * c) {
    return guarded([&]() -> bool {
        flush_pending(*c->draft, *c);
        return true;
    }, false);
}

size_t dflash_cache_state_size(dflash_cache * c) {
    if (!flush_for_reading(c)) {
        return 0;
    }
    const dflash_history & h = c->history;
    return sizeof(state_header) + (size_t) h.count * (sizeof(int32_t) + sizeof(float) * h.n_embd);
}

size_t dflash_cache_state_get(dflash_cache * c, uint8_t * dst, size_t size) {
    const size_t needed = dflash_cache_state_size(c);
    if (needed == 0) {
        return 0;
    }
    const dflash_history & h = c->history;
    if (size < needed) {
        dflash_impl::last_error = "the buffer is too small for the cross-context state";
        return 0;
    }
    const state_header head = {k_state_magic, k_state_version, h.n_embd, h.count, c->last_pos};
    uint8_t * out = dst;
    auto put = [&out](const void * src, size_t n) { std::memcpy(out, src, n); out += n; };
    put(&head, sizeof(head));
    for (int i = 0; i < h.count; ++i) {
        const int32_t p = h.pos_at(i);
        put(&p, sizeof(p));
    }
    for (int i = 0; i < h.count; ++i) {
        put(h.row_at(i), sizeof(float) * h.n_embd);
    }
    return out - dst;
}

int dflash_cache_state_set(dflash_cache * c, const uint8_t * src, size_t size) {
    return guarded([&]() -> int {
        state_header head;
        if (size < sizeof(head)) {
            fail("the cross-context state is truncated (%zu bytes)", size);
        }
        std::memcpy(&head, src, sizeof(head));
        dflash_history & h = c->history;
        if (head.magic != k_state_magic || head.version != k_state_version) {
            fail("not a cross-context state of this version");
        }
        if (head.n_embd != h.n_embd || head.count < 0 ||
            size != sizeof(head) + (size_t) head.count * (sizeof(int32_t) + sizeof(float) * h.n_embd)) {
            fail("the cross-context state does not fit this draft (%d rows of width %d in %zu bytes)",
                 head.count, head.n_embd, size);
        }
        const int32_t * pos = (const int32_t *) (src + sizeof(head));
        const float * rows = (const float *) (pos + head.count);
        c->keep_pending(0);
        for (int i = 0; i < head.count; ++i) {
            if (pos[i] < 0 || (i > 0 && pos[i] <= pos[i - 1]) || pos[i] > head.last_pos) {
                fail("the cross-context state's positions are not increasing");
            }
        }
        h.start = h.count = 0;
        for (int i = std::max(0, head.count - h.capacity); i < head.count; ++i) {
            h.push(rows + (size_t) i * h.n_embd, pos[i]);
        }
        c->last_pos = head.last_pos;
        c->stale = true;
        return 0;
    }, -1);
}

int dflash_cache_capacity(const dflash_cache * c, int il) { return c->layers.at(il).capacity; }
int dflash_cache_n_rows(const dflash_cache * c, int il) {
    const dflash_cache_layer & cl = c->layers.at(il);
    return std::min(cl.capacity, cl.n_used + c->n_pending());  // as once the pending rows are projected
}
size_t dflash_cache_size_bytes(const dflash_cache * c) { return ggml_backend_buffer_get_size(c->buf); }

int dflash_cache_append(dflash_draft * d, dflash_cache * c, const float * features, const int32_t * pos, int n_rows) {
    return guarded([&]() -> int {
        if (n_rows < 1) {
            fail("no context rows to append (%d)", n_rows);
        }
        for (int i = 0; i < n_rows; ++i) {
            if (pos[i] <= (i == 0 ? c->last_pos : pos[i - 1])) {
                fail("context positions must increase: row %d is at %d after %d", i, pos[i],
                     i == 0 ? c->last_pos : pos[i - 1]);
            }
        }
        if (d != c->draft) {
            fail("the cross-context belongs to another draft");
        }
        c->pending_features.insert(c->pending_features.end(), features,
                                   features + (size_t) n_rows * d->n_target_features);
        c->pending_pos.insert(c->pending_pos.end(), pos, pos + n_rows);
        c->last_pos = pos[n_rows - 1];
        if (c->n_pending() >= k_append_chunk) {
            flush_pending(*d, *c);
        }
        return 0;
    }, -1);
}

static void prepare_step(dflash_draft & d, dflash_cache & c, llama_token first_token, int32_t start_pos) {
    if (first_token < 0 || first_token >= d.n_vocab) {
        fail("token %d is outside the vocabulary", first_token);
    }
    if (start_pos <= c.last_pos) {
        fail("the block starts at %d but the context already reaches %d", start_pos, c.last_pos);
    }
    if (&d != c.draft) {
        fail("the cross-context belongs to another draft");
    }
    flush_pending(d, c);
}

int dflash_draft_step(dflash_draft * d, dflash_cache * c, llama_token first_token, int32_t start_pos, float * logits,
                      llama_token * tokens) {
    return guarded([&]() -> int {
        prepare_step(*d, *c, first_token, start_pos);
        run_step(*d, *c, first_token, start_pos, 0, d->block_size, logits, tokens);
        return 0;
    }, -1);
}

int dflash_draft_propose(dflash_draft * d, dflash_cache * c, llama_token first_token, int32_t start_pos, int n,
                         llama_token * tokens) {
    return guarded([&]() -> int {
        prepare_step(*d, *c, first_token, start_pos);
        if (n < 1 || n > d->block_size - 1) {
            fail("draft length %d outside 1..%d", n, d->block_size - 1);
        }
        run_step(*d, *c, first_token, start_pos, 1, n, nullptr, tokens);
        return 0;
    }, -1);
}
