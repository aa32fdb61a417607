// DFlash draft: the graphs that project context rows into a cross-context and run a draft step,
// and the C API of a step.

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
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

using dflash_impl::block_conv;
using dflash_impl::draft_layer;
using dflash_impl::fail;
using dflash_impl::flush_pending;
using dflash_impl::guarded;
using dflash_impl::k_append_chunk;
using dflash_impl::k_kv_pad;

namespace {

// One node, not a norm and a product: a draft step's graph is small enough that its node count
// (a thread barrier each) shows in its time.
ggml_tensor * rms_norm(ggml_context * ctx, ggml_tensor * x, ggml_tensor * weight, float eps) {
    return ggml_fused_rms_norm(ctx, x, weight, eps);
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

}  // namespace

// Project the pending rows into the rings and the history (see dflash_cache::pending_features).
void dflash_impl::flush_pending(dflash_draft & d, dflash_cache & c) {
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

namespace {

int n_scored(const dflash_draft & d) { return d.head_ids.empty() ? d.n_vocab : (int) d.head_ids.size(); }

// The step's logits as the head scores them, n_rows x n_scored floats, from tensors holding
// consecutive rows.
std::vector<float> read_scored(const dflash_draft & d, const std::vector<ggml_tensor *> & parts, int n_rows) {
    std::vector<float> scored((size_t) n_rows * n_scored(d));
    size_t at = 0;
    for (ggml_tensor * part : parts) {
        ggml_backend_tensor_get(part, scored.data() + at, 0, ggml_nbytes(part));
        at += ggml_nelements(part);
    }
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

}  // namespace

// One draft step (dflash-draft-state.h).
void dflash_impl::run_step(dflash_draft & d, dflash_cache & c, llama_token first, int32_t start, int head_row0,
                           int n_head, float * logits_out, llama_token * tokens_out, float * confidence_out) {
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
        ggml_tensor * ff = ggml_fused_up_gate(ctx, l.ffn_up, l.ffn_gate, n, GGML_UNARY_OP_SILU);  // silu(gate n) * (up n)
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
    // go to the host's selector. DSpark: the Markov chain's choices and the confidence head on the
    // backend. For confidences without a confidence head, each row's softmax at its argmax on the
    // backend too (row r of the softmax, element ids[r]): a selected token's probability follows
    // from it and two logits.
    std::vector<ggml_tensor *> scored_rows = {logits};
    ggml_tensor * ids = nullptr, * projected = nullptr, * confidence = nullptr;
    if (d.is_dspark()) {
        const dspark_outputs heads = dspark_heads(d, ctx, x, logits, ggml_view_1d(ctx, inp_tokens, 1, 0), head_row0);
        scored_rows = heads.rows;
        ids = heads.ids;
        confidence = confidence_out ? heads.confidence : nullptr;
    }
    if (d.is_dflash2()) {
        projected = ggml_mul_mat(ctx, d.selector_hidden, x);
        ggml_set_output(projected);
        ggml_build_forward_expand(gf, projected);
    }
    if (ids == nullptr && (!d.is_dflash2() || confidence_out)) {
        ids = ggml_argmax(ctx, logits);
    }
    if (ids != nullptr) {
        ggml_set_output(ids);
        ggml_build_forward_expand(gf, ids);
    }
    if (confidence_out && confidence == nullptr) {
        for (size_t part = 0, r = 0; part < scored_rows.size(); r += scored_rows[part]->ne[1], ++part) {
            ggml_tensor * rows = scored_rows[part];
            const int64_t n = rows->ne[1];
            ggml_tensor * probs = ggml_reshape_3d(ctx, ggml_soft_max(ctx, rows), 1, rows->ne[0], n);
            ggml_tensor * at = ggml_view_2d(ctx, ids, 1, n, ids->nb[0], r * ids->nb[0]);
            ggml_tensor * top = ggml_reshape_2d(ctx, ggml_get_rows(ctx, probs, at), 1, n);
            confidence = confidence ? ggml_concat(ctx, confidence, top, 1) : top;
        }
    }
    if (confidence != nullptr) {
        ggml_set_output(confidence);
        ggml_build_forward_expand(gf, confidence);
    }
    if (logits_out || d.is_dflash2()) {
        for (ggml_tensor * rows : scored_rows) {
            ggml_set_output(rows);
            ggml_build_forward_expand(gf, rows);
        }
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
        scored = read_scored(d, scored_rows, n_head);
    }
    if (logits_out) {
        expand_logits(d, scored, n_head, logits_out);
    }
    std::vector<int32_t> best(ids ? n_head : 0);  // indices into the scored ids
    if (ids) {
        ggml_backend_tensor_get(ids, best.data(), 0, ggml_nbytes(ids));
    }
    const int row0 = d.first_proposing_row();  // proposal i is block row row0 + i
    if (d.is_dflash2()) {
        std::vector<float> hidden((size_t) n_head * d.selector_rank);
        ggml_backend_tensor_get(projected, hidden.data(), 0, ggml_nbytes(projected));
        select_tokens(d, scored, hidden, head_row0, n_head, first, tokens_out);
    } else {
        for (int j = std::max(row0, head_row0); j < head_row0 + n_head; ++j) {
            const int32_t i = best[j - head_row0];
            tokens_out[j - row0] = d.head_ids.empty() ? i : d.head_ids[i];
        }
    }
    if (!confidence_out) {
        return;
    }
    std::vector<float> probability(n_head);
    ggml_backend_tensor_get(confidence, probability.data(), 0, ggml_nbytes(confidence));
    for (int j = std::max(row0, head_row0); j < head_row0 + n_head; ++j) {
        const int r = j - head_row0;
        float p = probability[r];
        if (d.is_dflash2()) {  // the selector may have chosen another id: p(top) * e^(logit - top logit)
            const float * logit = scored.data() + (size_t) r * n_scored(d);
            const llama_token token = tokens_out[j - row0];
            const int chosen = d.head_ids.empty() ? token
                             : (int) (std::lower_bound(d.head_ids.begin(), d.head_ids.end(), token) - d.head_ids.begin());
            p *= std::exp(logit[chosen] - logit[best[r]]);
        }
        confidence_out[j - row0] = p;
    }
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
        dflash_impl::run_step(*d, *c, first_token, start_pos, 0, d->block_size, logits, tokens, nullptr);
        return 0;
    }, -1);
}

int dflash_draft_propose(dflash_draft * d, dflash_cache * c, llama_token first_token, int32_t start_pos, int n,
                         llama_token * tokens, float * confidence) {
    return guarded([&]() -> int {
        prepare_step(*d, *c, first_token, start_pos);
        if (n < 1 || n > d->max_proposal()) {
            fail("draft length %d outside 1..%d", n, d->max_proposal());
        }
        dflash_impl::run_step(*d, *c, first_token, start_pos, d->first_proposing_row(), n, nullptr, tokens, confidence);
        return 0;
    }, -1);
}

