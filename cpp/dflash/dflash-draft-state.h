// The state a DFlash draft and its cross-contexts share across the files of the draft runtime:
// loading and checking the GGUF (dflash-draft-load.cpp), the graphs and the step
// (dflash-draft-step.cpp), and the cross-context's C API (dflash-draft-cache.cpp). Private to
// libikdflash; the math is docs/dflash.md, the names of keys and tensors docs/gguf.md.

#pragma once

#include "dflash.h"
#include "dflash-impl.h"
#include "dflash-mask.h"
#include "dflash-measure.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace dflash_impl {

constexpr int k_max_graph_nodes = 8192;  // a DFlash1 step's; a DFlash2 draft adds its convolutions
constexpr int k_append_chunk = 256;  // context rows projected per graph
// Keys per attention are padded to a multiple of this (zero rows, hidden by the mask), as the
// fork's own KV cache is: the CPU matrix kernels overrun odd-sized KQ products otherwise.
constexpr int k_kv_pad = 32;

// How the two draft formats name things (docs/gguf.md).
struct draft_format {
    const char * arch;
    const char * fc;
    const char * hidden_norm;
    const char * ffn_norm;
    const char * embedding_scale;    // keys after "<arch>."
    const char * output_multiplier;
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

}  // namespace dflash_impl

struct dflash_draft {
    std::string path;
    const dflash_impl::draft_format * format = nullptr;

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
    int graph_nodes = dflash_impl::k_max_graph_nodes;  // a step's graph holds at most this many
    // DSpark (docs/dflash.md): each proposing row's logits get a low-rank bias from the token
    // before it (markov_rank > 0), and a confidence head predicts whether the target keeps each
    // proposal. Either makes a draft DSpark.
    int markov_rank = 0;
    // Block row 0, the anchor's, proposes too: a pass proposes block_size tokens, not one fewer.
    bool anchor_first = false;
    // Sliding layers see the window's context rows before the block's first position, for every
    // block row alike, rather than a window behind each row.
    bool window_from_block = false;
    bool is_dspark() const { return markov_rank > 0 || confidence_w != nullptr; }
    int first_proposing_row() const { return anchor_first ? 0 : 1; }
    int max_proposal() const { return block_size - first_proposing_row(); }

    // weights (ours), and the target's embedding and head when the draft has none
    ggml_context * ctx_w = nullptr;
    ggml_backend_buffer_t buf_w = nullptr;
    ggml_tensor * fc = nullptr, * hidden_norm = nullptr, * output_norm = nullptr;
    ggml_tensor * tok_embd = nullptr, * output = nullptr;
    std::vector<dflash_impl::draft_layer> layers;
    ggml_tensor * selector_hidden = nullptr;  // [n_embd, rank]
    // DSpark: W1 {markov_rank, n_vocab} (a row per previous token), W1's rows as the head scores
    // them (the previous row's argmax indexes it), W2 {markov_rank, scored ids}; the confidence
    // head {n_embd [+ markov_rank], 1} over [hidden; W1 row] and its bias {1}.
    ggml_tensor * markov_prev = nullptr, * markov_prev_scored = nullptr, * markov_bias = nullptr;
    ggml_tensor * confidence_w = nullptr, * confidence_b = nullptr;
    dflash_impl::codebook predecessors, successors;
    // The ids the draft's head scores, increasing, when the file names a subset of the vocabulary
    // (dflash.head_token_ids; empty: all of it). The head is then those rows of the output matrix,
    // copied into a tensor of ours at load: a step reads a fraction of the vocabulary's weights.
    std::vector<llama_token> head_ids;
    ggml_context * ctx_head = nullptr;  // the head's rows, and W1's and W2's for a DSpark draft
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
    int64_t n_graph_computes = 0;  // graphs computed (appends and steps): dflash_draft_n_graph_computes

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
        return {is_sliding, full_attention ? false : causal[il], window, window_from_block};
    }

    ggml_context * graph_context() {
        ggml_init_params params = {graph_meta.size(), graph_meta.data(), /*no_alloc=*/true};
        return ggml_init(params);
    }

    // Assign gf's nodes to backends and allocate them; inputs can be set after this.
    void allocate(ggml_backend_sched_t sched, ggml_cgraph * gf) {
        ggml_backend_sched_reset(sched);
        if (!ggml_backend_sched_alloc_graph(sched, gf)) {
            dflash_impl::fail("could not allocate the draft's compute buffer");
        }
    }

    void compute(ggml_backend_sched_t sched, ggml_cgraph * gf, const char * what) {
        ++n_graph_computes;
        if (ggml_backend_sched_graph_compute(sched, gf) != GGML_STATUS_SUCCESS) {
            dflash_impl::fail("computing %s failed", what);
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

namespace dflash_impl {

// dflash-draft-load.cpp: a draft read, checked against its target and placed.
std::unique_ptr<dflash_draft> load_draft(const char * path, const llama_model * target,
                                         const dflash_draft_params & params);

// dflash-draft-step.cpp
void flush_pending(dflash_draft & d, dflash_cache & c);
// One draft step. The head, which costs more than the layers for a large vocabulary, runs only on
// block rows head_row0 .. head_row0 + n_head - 1. The layers run the whole block where a layer
// attends both ways within it; where every layer is causal, a row sees no row after it, so the
// rows past the last head row are left out. Each proposing head row's choice (its first-maximum
// argmax, a DFlash2 selector's or a DSpark chain's) goes to tokens_out, proposal i from block row
// first_proposing_row() + i; the logits leave the backend only when logits_out asks for them
// (sampling): greedy steps read n_head ids, not n_head x n_vocab floats from a GPU. confidence_out,
// when given, receives each proposal's confidence (dflash_seq_draft).
void run_step(dflash_draft & d, dflash_cache & c, llama_token first, int32_t start, int head_row0, int n_head,
              float * logits_out, llama_token * tokens_out, float * confidence_out);

// dflash-dspark.cpp: a DSpark draft's heads in the step graph.
struct dspark_outputs {
    // The head rows' logits: one [scored ids, 1] tensor a row with the Markov bias, or the head's
    // [scored ids, n_head] as they were without a Markov head.
    std::vector<ggml_tensor *> rows;
    ggml_tensor * ids;         // [n_head] I32: each row's best scored index, as the chain chose it
    ggml_tensor * confidence;  // [1, n_head]: the confidence head's probabilities, or null
};
// hidden: the head rows' normed states [n_embd, n_head] (block rows head_row0..); logits: the
// head's scores of them; anchor: an I32 [1] holding the block's first token.
dspark_outputs dspark_heads(const dflash_draft & d, ggml_context * ctx, ggml_tensor * hidden, ggml_tensor * logits,
                            ggml_tensor * anchor, int head_row0);

}  // namespace dflash_impl
