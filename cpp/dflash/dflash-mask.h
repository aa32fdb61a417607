// The DFlash draft's attention rule (docs: dflash.md, "Attention masks"), and the F16 masks
// built from it. Kept apart from the graph so it can be checked on its own.

#pragma once

#include "ggml.h"

#include <cstdint>

// Which keys one draft layer's queries may see.
struct dflash_mask_rule {
    bool sliding;  // the layer has a window
    bool causal;   // keys after the query are hidden
    int  window;   // W, used when sliding
    // The window is the W positions before the block's first, for every block row (speculators'
    // drafts), not the W up to each query (z-lab's).
    bool window_from_block = false;
};

// Whether a query at position qp, in a block starting at start, sees a key at position kp.
bool dflash_key_visible(const dflash_mask_rule & rule, int32_t qp, int32_t kp, int32_t start);

// Rows the flash-attention kernels expect in a mask (n_query padded to GGML_KQ_MASK_PAD), and
// columns: the key count padded to kv_pad (1 for the soft-max path; 256 for CUDA FA, whose
// kernels need K->ne[1] % 256 == 0).
int dflash_mask_rows(int n_query);
int dflash_mask_cols(int n_keys, int kv_pad);

// Fill an F16 mask of dflash_mask_rows(n_query) x dflash_mask_cols(n_ctx + n_query, kv_pad)
// (ggml layout: a row per query, ne0 = columns). Keys are the n_ctx context rows at key_pos
// (in storage order, any order) followed by the block at query positions start .. start+n_query-1.
// Visible = 0, hidden = -inf; padding rows and columns are hidden.
void dflash_fill_mask(ggml_fp16_t * mask, const dflash_mask_rule & rule, const int32_t * key_pos, int n_ctx,
                      int32_t start, int n_query, int kv_pad);
