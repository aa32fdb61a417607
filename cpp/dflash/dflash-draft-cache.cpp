// DFlash draft: the cross-context's C API: made, cleared, truncated, shifted, saved and
// restored, and appended to (rows wait to be projected until the draft next reads them).

#include "dflash-draft-state.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <algorithm>
#include <cstring>
#include <vector>

using dflash_impl::fail;
using dflash_impl::flush_pending;
using dflash_impl::guarded;
using dflash_impl::k_append_chunk;
using dflash_impl::k_kv_pad;

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
            // block row 0 is the oldest query: it sees window - 1 context rows at most (window
            // rows where the window is the block's)
            const bool sliding = d->rule(il, full_attention).sliding;
            const int seen = d->window_from_block ? d->window : d->window - 1;
            cl.capacity = sliding ? std::min(cross_ctx, std::max(0, seen)) : cross_ctx;
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
    if (c == nullptr) {
        return;
    }
    c->keep_pending(0);
    c->clear_rings();
    c->history.count = c->history.start = 0;
    c->stale = false;
    c->last_pos = -1;
}

void dflash_cache_truncate(dflash_cache * c, int32_t pos) {
    if (c == nullptr) {
        return;
    }
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
        if (c == nullptr) {
            return 0;
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
    if (c == nullptr || !flush_for_reading(c)) {
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
        if (c == nullptr) {
            if (size != 0) {
                fail("a sequence without a draft has no cross-context to put %zu bytes in", size);
            }
            return 0;
        }
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
