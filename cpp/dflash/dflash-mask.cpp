#include "dflash-mask.h"

#include <cmath>

bool dflash_key_visible(const dflash_mask_rule & rule, int32_t qp, int32_t kp, int32_t start) {
    if (rule.causal && kp > qp) {
        return false;
    }
    if (rule.sliding && rule.window_from_block) {
        return kp >= start - rule.window;
    }
    if (rule.sliding) {
        if (qp - kp >= rule.window) {
            return false;
        }
        // a bidirectional sliding layer has a symmetric window
        if (!rule.causal && kp - qp >= rule.window) {
            return false;
        }
    }
    return true;
}

int dflash_mask_rows(int n_query) {
    return GGML_PAD(n_query, GGML_KQ_MASK_PAD);
}

int dflash_mask_cols(int n_keys, int kv_pad) {
    return kv_pad > 1 ? GGML_PAD(n_keys, kv_pad) : n_keys;
}

void dflash_fill_mask(ggml_fp16_t * mask, const dflash_mask_rule & rule, const int32_t * key_pos, int n_ctx,
                      int32_t start, int n_query, int kv_pad) {
    const int n_rows = dflash_mask_rows(n_query);
    const int n_cols = dflash_mask_cols(n_ctx + n_query, kv_pad);
    const ggml_fp16_t visible = ggml_fp32_to_fp16(0.0f);
    const ggml_fp16_t hidden  = ggml_fp32_to_fp16(-INFINITY);
    for (int j = 0; j < n_rows; ++j) {
        ggml_fp16_t * row = mask + (size_t) j * n_cols;
        const int32_t qp = start + j;
        for (int c = 0; c < n_cols; ++c) {
            bool see = false;
            if (j < n_query && c < n_ctx + n_query) {
                const int32_t kp = c < n_ctx ? key_pos[c] : start + (c - n_ctx);
                see = kp >= 0 && dflash_key_visible(rule, qp, kp, start);  // kp < 0: an empty ring slot
            }
            row[c] = see ? visible : hidden;
        }
    }
}
