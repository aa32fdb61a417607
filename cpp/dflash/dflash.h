// DFlash draft runtime: a library on llama.h (libikdflash), which the fork's programs and the
// Python bindings link. Measurement and training entry points: dflash-measure.h.
//
// A DFlash draft reads the outputs of a few target layers ("features"), fuses each position's
// features into one context row, and proposes a block of tokens in a single forward pass. The
// semantics follow the DFlash reference (docs: dflash.md): exact positions, the whole block of
// block_size rows every step, and one attention mask per layer type (sliding / full).
//
// Usage, one sequence (dflash_engine below is this loop; llama-server's slots run it per slot):
//   dflash_draft * draft = dflash_draft_load("draft.gguf", target_model, dflash_draft_default_params());
//   dflash_capture * capture = dflash_capture_init(target_ctx, draft);
//   dflash_seq * seq = dflash_seq_init(draft, target_ctx, cross_ctx, false, seq_id);
//   per step: dflash_seq_draft(seq, token, pos, n, drafts); verify them in one llama_decode
//   (dflash_capture_begin before it, dflash_capture_check after), then dflash_seq_commit the
//   rows of the tokens kept.
// Failures return NULL or a negative value; dflash_last_error() says why.

#pragma once

#include "llama.h"

// Symbols the shared library exports (DFLASH_SHARED: built or used as one; DFLASH_BUILD: built).
#if defined(DFLASH_SHARED) && defined(_WIN32) && !defined(__MINGW32__)
#    define DFLASH_API __declspec(dllimport)
#    ifdef DFLASH_BUILD
#        undef DFLASH_API
#        define DFLASH_API __declspec(dllexport)
#    endif
#elif defined(DFLASH_SHARED)
#    define DFLASH_API __attribute__((visibility("default")))
#else
#    define DFLASH_API
#endif

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dflash_draft dflash_draft;  // weights and hyper-parameters, bound to one target model
typedef struct dflash_cache dflash_cache;  // the cross-context: per draft layer, projected K/V of context rows

// The reason for the last failure on this thread ("" if none).
DFLASH_API const char * dflash_last_error(void);
// Whether the caller's arguments caused it (an empty prompt, a bad n_max, a malformed IKDFLASH_COSTS),
// rather than the run (a failed decode or capture).
DFLASH_API bool dflash_last_error_is_argument(void);

typedef struct dflash_draft_params dflash_draft_params;
struct dflash_draft_params {
    int32_t n_threads;     // CPU threads for the parts that run on the CPU
    // Where the draft (weights, cross-contexts, compute) lives. The draft is small, so it is placed
    // whole: < 0 follows the target (the GPU holding the target's output layer, else the CPU);
    // 0 the CPU; > 0 a GPU (the one holding the target's output layer, else the first), or the
    // CPU in a build without GPU backends, as the target's n_gpu_layers is then ignored too.
    int32_t n_gpu_layers;
};

DFLASH_API dflash_draft_params dflash_draft_default_params(void);

// Check a GGUF file's header against the file before ggml parses it: counts, lengths, value types,
// tensor ranks, dimensions, types and extents. 0, or -1 with dflash_last_error() saying what is
// wrong. dflash_draft_load runs it; callers loading other GGUF files from untrusted sources can too.
DFLASH_API int dflash_gguf_check(const char * path);

// Load a draft GGUF (ik_llama.cpp's "dflash-draft" or upstream llama.cpp's "dflash") and check
// it against the target: vocabulary, mask token, target layer ids, feature width, embedding width.
DFLASH_API dflash_draft * dflash_draft_load(const char * path, const struct llama_model * target, dflash_draft_params params);
DFLASH_API void dflash_draft_free(dflash_draft * draft);
// The backend holding the draft: "CPU", "CUDA0", ...
DFLASH_API const char * dflash_draft_device(const dflash_draft * draft);

// Hyper-parameters.
DFLASH_API int  dflash_draft_block_size(const dflash_draft * draft);
// The most tokens one pass proposes: block_size - 1, or block_size where the anchor's own row
// proposes (an anchor-first DSpark draft).
DFLASH_API int  dflash_draft_max_proposal(const dflash_draft * draft);
DFLASH_API int  dflash_draft_mask_token(const dflash_draft * draft);
DFLASH_API int  dflash_draft_n_layer(const dflash_draft * draft);
DFLASH_API int  dflash_draft_sliding_window(const dflash_draft * draft);            // 0 = none
DFLASH_API bool dflash_draft_layer_is_sliding(const dflash_draft * draft, int il);
DFLASH_API bool dflash_draft_layer_is_causal(const dflash_draft * draft, int il);
DFLASH_API int  dflash_draft_n_target_layers(const dflash_draft * draft);
DFLASH_API int  dflash_draft_target_layer_id(const dflash_draft * draft, int i);
DFLASH_API int  dflash_draft_n_target_features(const dflash_draft * draft);
DFLASH_API const char * dflash_draft_format(const dflash_draft * draft);            // "dflash-draft" | "dflash"
// The ids the draft's head scores: a subset the draft was trained on (dflash.head_token_ids), whose
// rows of the output matrix are all a step reads, or the whole vocabulary.
DFLASH_API int  dflash_draft_n_head_tokens(const dflash_draft * draft);
// A DFlash2 draft's settings into out: conv_kernel_size, conv_group_size, selector_rank,
// selector_top_k. false (out untouched) for a DFlash1 draft.
DFLASH_API bool dflash_draft_dflash2_settings(const dflash_draft * draft, int32_t out[4]);
// A DSpark draft's settings into out: Markov rank (0: none), confidence head width (0: none;
// n_embd, or n_embd + rank with the Markov features), anchor-first (0/1), window from the block
// (0/1). false (out untouched) for a draft without DSpark's heads.
DFLASH_API bool dflash_draft_dspark_settings(const dflash_draft * draft, int32_t out[4]);

// Cross-context for one sequence. Full-attention layers keep the newest cross_ctx rows; sliding
// layers never keep more than their window needs (window - 1 rows), so their memory and attention
// cost do not grow with cross_ctx. full_attention = true runs every layer as a full-attention
// layer (windows ignored), for side-by-side validation.
// Besides the layers' projected keys/values (on the draft's device), the cache keeps in host
// memory the fused context row of its newest cross_ctx positions (n_embd floats each): after a
// truncation, a shift or a restored state, the layers are rebuilt from it exactly, so a sliding
// layer never loses rows its window still covers.
// The cache belongs to that draft: appends and steps take the same one. A sequence without a
// draft has none (dflash_seq_cache returns NULL): the functions below take NULL as an empty cache.
DFLASH_API dflash_cache * dflash_cache_init(dflash_draft * draft, int cross_ctx, bool full_attention);
DFLASH_API void   dflash_cache_free(dflash_cache * cache);
DFLASH_API void   dflash_cache_clear(dflash_cache * cache);
// Drop the rows at positions >= pos (the target rolled back or reuses a cached prompt prefix).
DFLASH_API void   dflash_cache_truncate(dflash_cache * cache, int32_t pos);
// The target's context shift: drop the rows at positions [p0, p1) and move those at >= p1 by
// delta (p1 + delta >= p0 when delta < 0). Returns 0 on success.
DFLASH_API int    dflash_cache_shift(dflash_cache * cache, int32_t p0, int32_t p1, int32_t delta);
// The cache's state as bytes (the rows and their positions), to save beside the target's own
// state and put back later into a cache of the same draft. get returns the bytes written (0 if
// size is too small); set returns 0 on success. size and get project the rows an append left
// pending first (0 if that fails, with dflash_last_error).
DFLASH_API size_t dflash_cache_state_size(dflash_cache * cache);
DFLASH_API size_t dflash_cache_state_get(dflash_cache * cache, uint8_t * dst, size_t size);
DFLASH_API int    dflash_cache_state_set(dflash_cache * cache, const uint8_t * src, size_t size);



// --- pieces of a speculative loop ---------------------------------------------------------------
// What a decoding loop with its own batching (llama-server) needs; dflash_engine below is the
// simple single-sequence loop built from the same pieces.

typedef struct dflash_capture dflash_capture;  // the draft's target-layer outputs, copied out of every target pass
typedef struct dflash_seq dflash_seq;      // one sequence's DFlash state: cross-context and recurrent snapshot

// Taps the context's layer outputs (one capture per context; dflash_capture_free removes it). The
// captured layers stay whole to the end of each pass: no scheduler split, one sync per ubatch.
DFLASH_API dflash_capture * dflash_capture_init(struct llama_context * ctx, const dflash_draft * draft);
DFLASH_API void dflash_capture_free(dflash_capture * capture);
// Call before each llama_decode. active: capture this pass (forgetting the last pass's rows);
// not active: skip this pass and keep the last pass's rows.
DFLASH_API void dflash_capture_begin(dflash_capture * capture, bool active);
// Call after llama_decode: 0 when the pass captured n_tokens rows of every layer. A failed capture
// (an output of another type or width) leaves llama_decode's return code at 0: check first.
DFLASH_API int  dflash_capture_check(const dflash_capture * capture, int n_tokens);

// A sequence seq_id of ctx (the target context whose passes are captured). draft may be NULL: a
// sequence verified with the lookup's tokens alone, which keeps only a hybrid target's snapshot.
DFLASH_API dflash_seq * dflash_seq_init(dflash_draft * draft, struct llama_context * ctx, int cross_ctx, bool full_attention,
                                        llama_seq_id seq_id);
DFLASH_API void dflash_seq_free(dflash_seq * seq);
// Forget all context rows, or those at positions >= pos (a new request that reuses the first
// pos tokens of the last one's prompt).
DFLASH_API void dflash_seq_reset(dflash_seq * seq);
DFLASH_API void dflash_seq_truncate(dflash_seq * seq, llama_pos pos);
// The cross-context of the sequence (for dflash_cache_shift and the state functions).
DFLASH_API dflash_cache * dflash_seq_cache(dflash_seq * seq);
// Commit rows (indices into the last pass's captured rows) at positions pos0, pos0+1, ...
DFLASH_API int  dflash_seq_commit(dflash_seq * seq, const dflash_capture * capture, const int32_t * rows, int n_rows,
                                  llama_pos pos0);
// Propose n tokens (n <= dflash_draft_max_proposal) after token t at position pos, and, when
// confidence is not NULL, each one's confidence: the draft's confidence head where it has one,
// else its probability under the draft's softmax. Returns 0 on success.
DFLASH_API int  dflash_seq_draft(dflash_seq * seq, llama_token t, llama_pos pos, int n, llama_token * out,
                                 float * confidence);
// Hybrid targets: save this sequence's recurrent state before a verification pass, and put it
// back after a rejection (then replay the accepted tokens). The copy stays in the state's own
// memory (the GPU's when offloaded). No-ops for other targets.
DFLASH_API void dflash_seq_save_state(dflash_seq * seq);
DFLASH_API void dflash_seq_restore_state(const dflash_seq * seq);

// --- adaptive block length ---------------------------------------------------------------------
// How many draft tokens a step verifies. A step that verifies k drafts costs t_draft + t_pass(k+1)
// and commits, in expectation, E(k) = 1 + sum over i <= k of prod over j <= i of p_j tokens, where
// p_j is the chance that the draft's j-th token is kept given that the ones before it were. k = 0
// is a plain one-token decode with no draft step. Before each step the controller picks the k
// with the most expected tokens per millisecond, from running estimates of p_j and of the costs.
//
// A step verifying k drafts has the draft propose k + 1 tokens (at most n_limit) every fourth step,
// and every step until position k + 1 has 4 observations; each proposed token is compared with the
// token the target commits at its position, in that step or a later one: position k + 1 stays
// measured, so the controller sees when a longer block would pay.
// The draft's cost is measured per tokens proposed (its head runs on that many rows). At k = 0 an
// occasional probe (a draft step of one token, compared, not verified) notices when the draft
// becomes right again: probes run where they cost 1% of plain decoding, and more often as hits
// beyond what the estimate expects add up to evidence that it turned right (a CUSUM); a new
// request (dflash_adapt_reset) is probed at its first plain step. Once probes have hit past that
// first one's evidence, a probe proposes the block that would pay were every position kept 90% of
// the time, so the later positions are measured too (where one draft does not pay but several do,
// one-token probes left k at 0). Each plain step also moves the
// quick estimates a tenth of the way back to slow ones (the last ~100 observations), so a run of
// misses that sent a draft which pays by a little to k = 0 does not keep it there. A k whose pass
// has another row count than the last pass also pays for rebuilding the target's graph
// (measured), a quarter of it per step, so k does not flip at every step where drafting pays
// about what it costs.
// A pass cost no pass has measured for 256 passes (a k the controller stopped choosing, perhaps on
// a cost calibrated too high) is measured again: one draft more is verified for two steps.
//
// A proposal that needs no draft step (an n-gram lookup's) competes with the draft at each step:
// the step verifies whichever buys the most tokens per millisecond, its k priced the same way with
// no draft step, and the draft does not run when the lookup wins.
//
// Where the controller uses them (dflash_adapt_use_confidence), each draft token's confidence
// (dflash_seq_draft) is calibrated against what the target kept, per position and confidence
// tenth. Once the draft has run, the step verifies the leading part of its proposal with the most
// expected tokens per millisecond by those calibrated chances: fewer than planned where the draft
// is unsure, more (up to what it proposed) where it is sure. A fixed floor (conf_min, llama.cpp's
// --spec-draft-conf-min) verifies nothing from the first token below it. The plan, whether and how
// much to draft, does not use them.
//
// Usage, per step of a sequence (the draft's cross-context is fed by every target pass anyway;
// dflash_spec below is this, written once for the engine and llama-server):
//   dflash_adapt_offer_lookup(adapt, lookup_tokens, n);  // optional
//   plan = dflash_adapt_plan_step(adapt, n_limit);      // n_limit: what block, budget, context allow
//   n = plan.n_verify;
//   if (plan.n_draft > 0) { draft plan.n_draft tokens; n = dflash_adapt_proposed(adapt, tokens, conf, plan.n_draft); }
//   verify the first plan.n_verify of the lookup's tokens when plan.lookup, else the first n drafts
//   (0: a one-token decode);
//   dflash_adapt_committed(adapt, plan.n_verify, committed_tokens, n_committed);

#define DFLASH_MAX_VERIFY 63  // the most drafts a step can verify (a block of 64)
#define DFLASH_LOOKUP_MAX_RUN 15  // without a draft, the most looked-up tokens a step verifies

typedef struct dflash_costs dflash_costs;  // measured costs of a target context's passes by row count, and of a draft step
typedef struct dflash_adapt dflash_adapt;  // one sequence's controller

// Costs of passes of 1..max_rows rows (a server: every slot's block), unknown until set, calibrated
// or observed.
DFLASH_API dflash_costs * dflash_costs_init(int max_rows);
DFLASH_API void   dflash_costs_free(dflash_costs * costs);
// Time passes of 1..max_rows rows on ctx (sequence 0, a few rounds; the fastest of each counts;
// past 16 rows every fourth count, those between interpolated), and a graph rebuild: each count's
// first pass after another count's, against its second.
// The context's cache is cleared before and after: call it before the context serves sequences.
// Tests: IKDFLASH_COSTS="draft_ms:pass_ms_1,pass_ms_2,..." sets fixed costs instead (no timing,
// observations ignored), so the controller's choices are the same on any machine.
DFLASH_API int    dflash_costs_calibrate(dflash_costs * costs, struct llama_context * ctx);
// Observed times (a pass over n_rows rows of any sequences; a draft step proposing n_tokens),
// folded into the estimates. A pass counts only after one of as many rows (the steady cost of a
// k: the target reuses its graph for a pass of the same shape), one after another shape for what
// rebuilding the graph costs more; every pass must be reported, a larger one than max_rows too.
// A draft step after more than one pass (a probe, the first drafting step after plain ones or a
// prompt) first projects the context rows they added: it counts for the probes' cost, not as the
// cost of a drafting step of n_tokens.
DFLASH_API void   dflash_costs_observe_pass(dflash_costs * costs, int n_rows, double ms);
DFLASH_API void   dflash_costs_observe_draft(dflash_costs * costs, int n_tokens, double ms);
DFLASH_API double dflash_costs_pass_ms(const dflash_costs * costs, int n_rows);     // 0 while unknown
// What a pass costs more when the one before had another row count (the target rebuilds its graph).
DFLASH_API double dflash_costs_rebuild_ms(const dflash_costs * costs);
// A count not yet observed costs what the nearest larger one observed does, else the nearest smaller.
DFLASH_API double dflash_costs_draft_ms(const dflash_costs * costs, int n_tokens);  // 0 while unknown
DFLASH_API int    dflash_costs_max_rows(const dflash_costs * costs);

typedef struct dflash_adapt_plan dflash_adapt_plan;
struct dflash_adapt_plan {
    int32_t n_draft;   // tokens the draft proposes this step (0: no draft step)
    int32_t n_verify;  // of which the first n_verify are verified (0: a one-token decode)
    bool    lookup;    // the step verifies the first n_verify tokens of the lookup's offer instead
                       // (n_draft is then 0: the draft does not run)
};

typedef struct dflash_adapt_stats dflash_adapt_stats;
struct dflash_adapt_stats {
    int64_t n_steps_at[DFLASH_MAX_VERIFY + 1];  // steps by the drafts they verified; [0] one-token decodes
    int64_t n_probes;                           // draft steps whose tokens were only compared
    int64_t n_load_plain;                       // one-token decodes that alone would have drafted (load)
    int64_t n_lookup_steps;                     // steps that verified the lookup's tokens
    int64_t n_confidence_cut;                   // draft steps whose confidence changed how many were verified
    struct {                                    // the draft's tokens by their calibrated acceptance's tenth:
        int64_t n, kept;                        // how many were compared, and kept,
        double  predicted;                      // and the sum of their predicted acceptance
    } calibration[10];
};

// costs NULL: a fixed block length (every step verifies n_limit drafts, as without a controller).
// The controller reads costs (shared by the context's sequences) but never changes them.
DFLASH_API dflash_adapt * dflash_adapt_init(const dflash_costs * costs, int n_max);
// A sequence with no draft: each step verifies the lookup's offer where it pays, else decodes one
// token (costs must be given).
DFLASH_API dflash_adapt * dflash_adapt_init_draftless(const dflash_costs * costs, int n_max);
DFLASH_API void dflash_adapt_free(dflash_adapt * adapt);
// A new request on the sequence: pending proposals and statistics are dropped, the acceptance
// estimates kept at half weight, the probe interval kept.
DFLASH_API void dflash_adapt_reset(dflash_adapt * adapt);
DFLASH_API struct dflash_adapt_plan dflash_adapt_plan_step(dflash_adapt * adapt, int n_limit);

// Several sequences in one pass (a server's slots): a step's time is the pass over all their rows
// plus every draft step before it, and it commits all their tokens. A sequence planned with
// dflash_adapt_plan_step_in picks the k with the most tokens per millisecond for the whole step,
// the others' parts as they last planned them: where its draft rows cost the shared pass more
// than they commit (many slots on a CPU), it decodes one token, and it drafts again as slots free
// up. Alone it plans as dflash_adapt_plan_step does.
typedef struct dflash_load dflash_load;
DFLASH_API dflash_load * dflash_load_init(int n_seq);
DFLASH_API void dflash_load_free(dflash_load * load);
// A sequence's part of the coming pass: its rows (0: not in it), the tokens it commits in
// expectation, and its draft step's time. For sequences that plan without a controller; a plan
// made with dflash_adapt_plan_step_in records its own.
DFLASH_API void dflash_load_set(dflash_load * load, int seq, int n_rows, double n_tokens, double draft_ms);
DFLASH_API struct dflash_adapt_plan dflash_adapt_plan_step_in(dflash_adapt * adapt, int n_limit, dflash_load * load,
                                                              int seq);
// How the controller uses each draft token's confidence: calibrated_cut (adaptive controllers
// only) lets it set how many are verified, as above; conf_min > 0 verifies no token from the first
// whose confidence is below it, in either kind of controller. Both off at init; reset keeps them.
DFLASH_API void dflash_adapt_use_confidence(dflash_adapt * adapt, bool calibrated_cut, float conf_min);
// Whether the controller reads confidences: pass them to dflash_adapt_proposed then (NULL
// otherwise, and the draft computes none).
DFLASH_API bool dflash_adapt_wants_confidence(const dflash_adapt * adapt);
// The tokens the draft proposed for the positions after the current token, and each one's
// confidence (NULL: none). Returns how many of them the step verifies: plan.n_verify, or with
// confidences and the calibrated cut the leading part with the most expected tokens per
// millisecond, each token expected to be kept as often as the draft's tokens at its position and
// confidence have been (calibrated as the run goes); never a token from the first below conf_min.
// 0 after a plan that verifies the lookup's tokens.
DFLASH_API int  dflash_adapt_proposed(dflash_adapt * adapt, const llama_token * tokens, const float * confidence, int n);
// A proposal that costs no draft step (the n-gram lookup below) for the positions after the
// current token, offered before the step is planned. The next plan verifies its first k tokens
// instead of drafting when that buys the most tokens per millisecond: its acceptance per position
// is measured on every offer, verified or not, as the draft's is. An adaptive controller only.
DFLASH_API void dflash_adapt_offer_lookup(dflash_adapt * adapt, const llama_token * tokens, int n);
// The tokens the step committed after the current token, in order, and how many drafts it verified.
DFLASH_API void dflash_adapt_committed(dflash_adapt * adapt, int n_verified, const llama_token * tokens, int n);
// The estimate of p_j, j = 1..n_max, for the draft's tokens and for the lookup's.
DFLASH_API float dflash_adapt_acceptance(const dflash_adapt * adapt, int j);
DFLASH_API float dflash_adapt_lookup_acceptance(const dflash_adapt * adapt, int j);

// --- proposers that need no model --------------------------------------------------------------
// A proposer the caller plugs in: the n-gram lookup over the prompt and the reply so far is the
// base's (common/ngram-map.h), which libikdflash does not link; llama-server and the Python
// bindings wrap it (cpp/lookup/ngram-lookup.h). propose writes up to n_max tokens likely to follow
// the current token, after tokens[0..n_tokens), and returns how many (0: no match).
typedef struct dflash_lookup dflash_lookup;
struct dflash_lookup {
    int (*propose)(void * state, const llama_token * tokens, int n_tokens, llama_token current, int n_max,
                   llama_token * out);
    void * state;
};

// --- one sequence's speculation step -----------------------------------------------------------
// The step the engine and llama-server both run for a sequence (the usage above, written once):
// before the target's pass, the lookup's offer, the controller's plan (alone, or within the load
// of a pass the sequence shares), the draft's proposal with its confidences and its time; after
// it, what the target kept. It borrows its handles, which outlive it.
typedef struct dflash_spec dflash_spec;
// seq: the sequence's draft state (NULL, or one without a draft: the lookup alone); adapt: its
// controller (NULL: every step a one-token decode); costs: where draft steps are timed (NULL: not).
DFLASH_API dflash_spec * dflash_spec_init(dflash_seq * seq, dflash_adapt * adapt, dflash_costs * costs);
DFLASH_API void dflash_spec_free(dflash_spec * spec);
// The lookup offered at every step (NULL: none).
DFLASH_API void dflash_spec_set_lookup(dflash_spec * spec, const dflash_lookup * lookup);
// The load of the pass the sequence shares with others, as sequence load_seq (NULL: alone).
DFLASH_API void dflash_spec_set_load(dflash_spec * spec, dflash_load * load, int load_seq);

typedef struct dflash_proposal dflash_proposal;
struct dflash_proposal {
    int32_t n_verify;             // the tokens the step verifies (0: a one-token decode)
    bool    lookup;               // they are the lookup's (a draft step, if one ran, was a probe)
    int32_t n_drafted;            // the draft's tokens this step (0: no draft step)
    const llama_token * drafted;  // them; valid until the next call
    double  draft_ms;             // the draft step's time
};
// The step after the current token at pos, the tokens before it tokens[0..n_tokens) (what the
// lookup searches): at most limit tokens to verify, written to out (room for limit). When there
// are any, a hybrid target's recurrent state is saved (the pass runs it over them). Returns 0, or
// -1 when the draft step failed (dflash_last_error(); nothing to verify).
DFLASH_API int dflash_spec_propose(dflash_spec * spec, const llama_token * tokens, int n_tokens, llama_token current,
                                   llama_pos pos, int limit, llama_token * out, dflash_proposal * proposal);
// The step's outcome: of n_verified tokens verified (0: a one-token decode), the target committed
// committed[0..n_committed), the kept ones and its own.
DFLASH_API void dflash_spec_accept(dflash_spec * spec, int n_verified, const llama_token * committed, int n_committed);
DFLASH_API struct dflash_adapt_stats dflash_adapt_get_stats(const dflash_adapt * adapt);

// --- the speculative engine ---------------------------------------------------------------------
// One sequence (seq 0) of a target context, drafted by a DFlash draft: draft a block, verify it in
// one target batch, keep the longest matching prefix plus the target's own next token, roll the
// target back (KV cache; for hybrid targets also the recurrent state, by snapshot + replay), and
// feed the committed rows' features to the draft. With n_max = 0 it is plain target decoding, so
// speculative and plain generation run through the same loop, on the same memory; nothing is
// captured for the draft then (the next generation starts its cross-context from its prompt).

typedef struct dflash_engine dflash_engine;

typedef struct dflash_engine_params dflash_engine_params;
struct dflash_engine_params {
    int32_t cross_ctx;       // context rows kept by full-attention draft layers
    bool    full_attention;  // run every draft layer as full attention (windows ignored)
};

typedef struct dflash_stats dflash_stats;
struct dflash_stats {
    int64_t n_prompt;        // prompt tokens processed
    int64_t n_generated;     // tokens returned
    int64_t n_drafted;       // draft tokens offered for verification
    int64_t n_accepted;      // draft tokens accepted
    int64_t n_steps;         // target passes after the prompt: n_generated = 1 + n_accepted + n_steps
                             // (the prompt pass gives the first token), less one if it ended at a stop token
    int64_t n_lookup_drafted;   // of n_drafted, the lookup's tokens (the rest are the draft's)
    int64_t n_lookup_accepted;  // of n_accepted, the lookup's
    double  t_prompt_ms;
    double  t_draft_ms;
    double  t_verify_ms;     // target passes, sampling and rollback
    int32_t end_reason;      // enum dflash_end_reason
    struct dflash_adapt_stats block;  // steps by the drafts they verified, probes
};

// Why a generation ended.
typedef enum dflash_end_reason {
    DFLASH_END_LENGTH  = 0,  // max_tokens returned
    DFLASH_END_EOG     = 1,  // the target produced an end-of-generation token
    DFLASH_END_CONTEXT = 2,  // the context is full
    DFLASH_END_CALLER  = 3,  // the commit callback asked to stop
} dflash_end_reason;

// Called during dflash_engine_generate with the tokens each step commits, in order (the first
// call holds the token of the prompt pass), before the next step starts; returning false ends
// the generation there. For streaming and stop strings.
typedef bool (*dflash_commit_callback)(const llama_token * tokens, int n_tokens, void * user_data);

// The engine holds the target context's capture (dflash_capture_init) while it lives.
// draft may be NULL: the engine then generates with the target alone, or with n_max > 0 verifies
// the lookup's tokens (dflash_engine_set_lookup) where they pay (adaptive only; n_max at most
// DFLASH_LOOKUP_MAX_RUN).
DFLASH_API dflash_engine * dflash_engine_init(struct llama_context * target, dflash_draft * draft, dflash_engine_params params);
DFLASH_API void dflash_engine_free(dflash_engine * engine);

// How the target picks each token: one chain for every position, drafted or not, so a draft token
// is kept exactly when the target alone would have picked it there. Order (as llama.cpp's common
// sampler): repetition penalty, then greedy at temperature 0, else top-k, top-p, min-p (on the
// probabilities at temperature 1), temperature, and a draw of the generator seeded with seed.
typedef struct dflash_sampling dflash_sampling;
struct dflash_sampling {
    float    temperature;     // 0: greedy
    uint32_t seed;
    int32_t  top_k;           // 0: off
    float    top_p;           // 1: off
    float    min_p;           // 0: off
    float    repeat_penalty;  // 1: off
    int32_t  repeat_last_n;   // tokens the penalty looks back over, the prompt's included
    int32_t  n_probs;         // > 0: report the log-probabilities of this many most likely tokens
};

// Greedy, nothing filtered, no penalty, no log-probabilities.
DFLASH_API struct dflash_sampling dflash_sampling_default(void);

// Per returned token (room for max_tokens; top_* for max_tokens * n_probs): its log-probability
// under the target (log-softmax of the raw logits), and the n_probs most likely tokens with theirs.
typedef struct dflash_logprobs dflash_logprobs;
struct dflash_logprobs {
    float *       token;
    llama_token * top_ids;
    float *       top;
};

// Generate up to max_tokens after the prompt into out (room for max_tokens), picking tokens as
// sampling says (NULL: dflash_sampling_default()). Stops at an end-of-generation token (not
// returned) or when the context is full. Returns the number of tokens written, or -1 (see
// dflash_last_error()). step_lengths (may be NULL, room for max_tokens) receives the tokens each
// verification pass returned (accepted drafts + 1); logprobs (may be NULL; used when
// sampling->n_probs > 0) what dflash_logprobs says. adaptive: each step verifies as many of up
// to n_max drafts as pay (the adaptive block length above; the target's passes are timed at the
// first adaptive call); false: every step verifies n_max (fewer near the end or the context's).
DFLASH_API int dflash_engine_generate(dflash_engine * engine, const llama_token * prompt, int n_prompt, int max_tokens,
                                      int n_max, bool adaptive, const struct dflash_sampling * sampling, llama_token * out,
                                      dflash_stats * stats, int32_t * step_lengths, struct dflash_logprobs * logprobs);

// The callback the engine's next generations report their tokens to (NULL: none).
DFLASH_API void dflash_engine_set_commit_callback(dflash_engine * engine, dflash_commit_callback callback,
                                                  void * user_data);
// The lookup the engine's next adaptive generations offer the controller at every step (NULL:
// none). The caller keeps it alive meanwhile.
DFLASH_API void dflash_engine_set_lookup(dflash_engine * engine, const dflash_lookup * lookup);
// How the engine's next generations use each draft token's confidence (dflash_adapt_use_confidence:
// the calibrated cut, adaptive generations only; conf_min, any). Default neither: the draft then
// computes no confidences.
DFLASH_API void dflash_engine_set_confidence(dflash_engine * engine, bool calibrated_cut, float conf_min);

// --- command line --------------------------------------------------------------------------------

// What `--spec-type dflash:k=v,...` sets. Keys, as ik_llama.cpp spells them: n_max, n_min,
// p_min, cross_ctx (alias dflash_cross_ctx); llama.cpp's: conf_min; ours: full_attention,
// log_drafts, adaptive (0/1), min_accept, lookup (0/1), confidence (0/1). cross_ctx 0 means
// "follow the context size".
typedef struct dflash_spec_options dflash_spec_options;
struct dflash_spec_options {
    int32_t n_max;
    int32_t n_min;
    float   p_min;
    int32_t cross_ctx;
    bool    full_attention;
    bool    log_drafts;      // ours: log every proposal (tests compare them across server paths)
    float   min_accept;      // ours: stop drafting for a request whose recent acceptance is below this (0: never)
    bool    adaptive;        // ours: each step verifies as many of up to n_max drafts as pay (default on)
    bool    lookup;          // ours: an n-gram lookup proposes beside the draft (default on; adaptive only)
    bool    confidence;      // ours: each draft token's confidence sets how many are verified (default off; adaptive only)
    float   conf_min;        // llama.cpp's: no draft token from the first whose confidence is below this is verified (0: none)
    bool    draftless;       // --spec-type lookup: the n-gram lookup alone, with no draft
};

// The options' defaults: n_max 16, n_min 0 and p_min 0.75 as the fork's own; adaptive and lookup on.
DFLASH_API dflash_spec_options dflash_spec_default_options(void);

// Parse the part after "dflash:" into options (fields not named keep their values). Returns 0,
// or -1 with dflash_last_error() naming the key and the problem.
DFLASH_API int dflash_parse_spec_options(const char * text, dflash_spec_options * options);

// The same, and *named gets the bit of each field the text names (DFLASH_SPEC_<FIELD>), so a
// caller with defaults of its own (the Python package's SpecType) parses with this one parser.
enum {
    DFLASH_SPEC_N_MAX = 1 << 0, DFLASH_SPEC_N_MIN = 1 << 1, DFLASH_SPEC_P_MIN = 1 << 2,
    DFLASH_SPEC_CROSS_CTX = 1 << 3, DFLASH_SPEC_FULL_ATTENTION = 1 << 4, DFLASH_SPEC_LOG_DRAFTS = 1 << 5,
    DFLASH_SPEC_MIN_ACCEPT = 1 << 6, DFLASH_SPEC_ADAPTIVE = 1 << 7, DFLASH_SPEC_LOOKUP = 1 << 8,
    DFLASH_SPEC_CONFIDENCE = 1 << 9, DFLASH_SPEC_CONF_MIN = 1 << 10,
};
DFLASH_API int dflash_parse_spec_options_named(const char * text, dflash_spec_options * options, uint32_t * named);

// A whole `--spec-type` value. Returns 1 when it names DFlash: "dflash[:keys]", llama.cpp's
// "draft-dflash", DSpark's "dspark" and "draft-dspark" (the draft file says which it is), or the
// lookup alone, "lookup[:keys]" (draftless set); its keys are parsed into options, and named (if
// not NULL) gets their bits. Returns 0 for any other type (options untouched), and -1 with
// dflash_last_error() for bad keys.
DFLASH_API int dflash_parse_spec_type(const char * value, dflash_spec_options * options, uint32_t * named);

// The command-line help of those types and their keys.
DFLASH_API const char * dflash_spec_type_usage(void);

// --- fault injection (tests) ---------------------------------------------------------------------

// True on the calls that the environment variable IKDFLASH_FAULTS="point@k,..." names: the k-th
// call (from 1) for that point; every other call, and every call without the variable, is false.
// Points: "capture" (a captured layer output is refused, as one of the wrong type or width is);
// "decode_kv_full" (llama-server's decode finds no room in the KV cache).
DFLASH_API bool dflash_fault(const char * point);

#ifdef __cplusplus
}
#endif
