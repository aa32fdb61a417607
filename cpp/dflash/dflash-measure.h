// DFlash measurement and training entry points, apart from what a decoding loop needs
// (dflash.h): a draft step on given rows with its logits, the cross-context fed and inspected
// directly, target layer outputs captured for training data, and fixed pass costs for tests.

#pragma once

#include "dflash.h"

#ifdef __cplusplus
extern "C" {
#endif

// --- the draft on its own ------------------------------------------------------------------------

// Append context rows: features is n_rows x n_target_features floats, row-major, each row the
// concatenation of the target layers in the draft's order; pos are the rows' target positions,
// increasing. Returns 0 on success. Rows are projected into the layers in batches: when 256 are
// pending, or at the next draft step, shift or state read, so appending a row at a time is cheap.
DFLASH_API int dflash_cache_append(dflash_draft * draft, dflash_cache * cache,
                                   const float * features, const int32_t * pos, int n_rows);

// One draft step on the block [block[0], mask, ..., mask] (block_size tokens, block[0] at
// start_pos). logits (block_size x n_vocab floats) may be NULL; tokens receives the proposals of
// every proposing row (dflash_draft_max_proposal ids: rows 1..block_size-1, or 0..block_size-1
// for an anchor-first draft). Returns 0 on success.
DFLASH_API int dflash_draft_step(dflash_draft * draft, dflash_cache * cache, llama_token first_token,
                                 int32_t start_pos, float * logits, llama_token * tokens);
// The same step for speculation: tokens receives the first n proposals only (1 <= n <=
// dflash_draft_max_proposal); the whole block still runs through the layers, but the head only on
// the rows proposing them. confidence (n floats, may be NULL) receives each token's confidence
// (dflash_seq_draft).
DFLASH_API int dflash_draft_propose(dflash_draft * draft, dflash_cache * cache, llama_token first_token,
                                    int32_t start_pos, int n, llama_token * tokens, float * confidence);

DFLASH_API int    dflash_cache_capacity(const dflash_cache * cache, int il);  // rows kept by layer il
DFLASH_API int    dflash_cache_n_rows(const dflash_cache * cache, int il);    // rows held now
DFLASH_API size_t dflash_cache_size_bytes(const dflash_cache * cache);       // the layers' keys/values

// --- training data -------------------------------------------------------------------------------

// A capture (dflash_capture_init) of target layers named directly: training data for a new draft.
DFLASH_API dflash_capture * dflash_capture_init_layers(struct llama_context * ctx, const int32_t * layer_ids, int n_layers);
// Rows captured by the last pass (one per batch token, in batch order).
DFLASH_API int  dflash_capture_n_rows(const dflash_capture * capture);
// Copy the last pass's feature rows (layers concatenated in capture order) into out, which holds
// n_rows x n_layers x n_embd floats. Returns 0 on success.
DFLASH_API int  dflash_capture_features(const dflash_capture * capture, float * out, int n_rows);

// --- costs ----------------------------------------------------------------------------------------

// pass_ms: max_rows times, for 1..max_rows rows (a known machine; tests). Returns 0 on success.
DFLASH_API int    dflash_costs_set_passes(dflash_costs * costs, const double * pass_ms);

// How many graphs the draft has computed (context rows projected, draft steps) since it was
// loaded: a step at k = 0 runs none, which tests count.
DFLASH_API int64_t dflash_draft_n_graph_computes(const dflash_draft * draft);

// The clock the runtime times its passes with: steady, in milliseconds.
DFLASH_API double dflash_now_ms(void);

// --- target passes --------------------------------------------------------------------------------

// batch = n tokens of sequence 0 at positions pos0.., with logits for every row or the last only,
// as the runtime's own passes are (batch holds at least n tokens).
DFLASH_API void   dflash_batch_seq0(struct llama_batch * batch, const llama_token * tokens, int n, llama_pos pos0,
                                    bool all_logits);

#ifdef __cplusplus
}
#endif
