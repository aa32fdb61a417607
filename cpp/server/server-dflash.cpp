// llama-server's DFlash speculative decoding (--spec-type dflash): loading the draft, each slot's
// cross-context, drafting, and committing the verified rows; and the n-gram lookup, beside the
// draft or alone (--spec-type lookup: the same slots and controller, with no draft). server-context.cpp calls these from
// its hooks; the DFlash runtime itself is libikdflash (dflash.h). This file is compiled into
// llama-server from this repository: the patch series (patch
// `server-DFlash-speculative-decoding-spec-type-dflash-`) adds it to the server's sources and keeps
// only the declarations and the hooks that call it.

#include "server-context.h"
#include "server-common.h"

#include "common.h"
#include "llama.h"
#include "log.h"

#include <algorithm>
#include <fstream>
#include <iterator>

// The most tokens a slot's step verifies: n_max, bounded by what one draft pass proposes, or
// without a draft by DFLASH_LOOKUP_MAX_RUN.
int server_context::dflash_n_max() const {
    const int most = draft_dflash ? dflash_draft_max_proposal(draft_dflash) : DFLASH_LOOKUP_MAX_RUN;
    return std::min(params_base.speculative.n_max, most);
}

bool server_context::load_dflash_draft() {
    const bool draftless = params_base.speculative.dflash_draftless;
    if (!params_base.mmproj.path.empty()) {
        LOG_ERROR("--spec-type dflash is not supported with a multimodal projector", {});
        return false;
    }
    if (draftless) {
        if (!params_base.speculative.model.empty()) {
            LOG_ERROR("--spec-type lookup takes no draft: with --model-draft, use --spec-type dflash", {});
            return false;
        }
        return dflash_rows_fit_the_batch();
    }
    if (params_base.speculative.model.empty()) {
        LOG_ERROR("--spec-type dflash needs the DFlash draft: pass it with --model-draft", {});
        return false;
    }
    dflash_draft_params dparams = dflash_draft_default_params();
    dparams.n_threads = params_base.n_threads;
    dparams.n_gpu_layers = params_base.speculative.n_gpu_layers;  // -ngld; default -1: like the target
    draft_dflash = dflash_draft_load(params_base.speculative.model.c_str(), model, dparams);
    if (draft_dflash == nullptr) {
        LOG_ERROR("failed to load the DFlash draft", { {"error", dflash_last_error()} });
        return false;
    }
    if (!dflash_rows_fit_the_batch()) {
        return false;
    }
    // the draft's history: -cd (--ctx-size-draft), as upstream sets a DFlash draft's, or
    // cross_ctx; both only when they agree
    const int32_t cross_ctx = params_base.speculative.dflash_cross_ctx;
    const int32_t ctx_draft = params_base.speculative.n_ctx;
    if (cross_ctx > 0 && ctx_draft > 0 && cross_ctx != ctx_draft) {
        LOG_ERROR("DFlash: two lengths for the draft's history", {
            {"error", "--spec-type dflash:cross_ctx=" + std::to_string(cross_ctx) + " and -cd " +
                      std::to_string(ctx_draft) + " disagree; give one of them"} });
        return false;
    }
    if (ctx_draft > 0) {
        params_base.speculative.dflash_cross_ctx = ctx_draft;
    }
    return true;
}

// Every slot's verification rows (the sampled token and its drafts) share one batch.
bool server_context::dflash_rows_fit_the_batch() const {
    const int n_rows_slot = dflash_n_max() + 1;
    if ((int64_t) params_base.n_parallel * n_rows_slot <= (int64_t) llama_n_batch(ctx)) {
        return true;
    }
    LOG_ERROR("DFlash: the verification rows do not fit the batch", {
        {"error", std::to_string(params_base.n_parallel) + " slots x " + std::to_string(n_rows_slot) +
                  " rows (n_max + 1) exceed --batch-size " + std::to_string(llama_n_batch(ctx)) +
                  "; raise --batch-size or lower --parallel or n_max"} });
    return false;
}

// The capture of the target's layer outputs, and the history length each slot's cross-context
// keeps (returned; the slot context unless set).
int32_t server_context::init_dflash(int32_t n_ctx_slot) {
    const int32_t dflash_cross_ctx = params_base.speculative.dflash_cross_ctx > 0 ? params_base.speculative.dflash_cross_ctx : n_ctx_slot;
    if (params_base.speculative.dflash_draftless) {
        time_dflash_passes();
        return dflash_cross_ctx;
    }
    if (draft_dflash == nullptr) {
        return dflash_cross_ctx;
    }
    capture_dflash = dflash_capture_init(ctx, draft_dflash);
    const int window = dflash_draft_sliding_window(draft_dflash);
    const int block = dflash_draft_block_size(draft_dflash);
    int n_sliding = 0;
    for (int il = 0; il < dflash_draft_n_layer(draft_dflash); ++il) {
        n_sliding += dflash_draft_layer_is_sliding(draft_dflash, il);
    }
    // the window hides context rows only once more than window - block rows are kept
    const bool engages = n_sliding > 0 && !params_base.speculative.dflash_full_attention && dflash_cross_ctx > window - block;
    LLAMA_LOG_INFO("dflash: cross_ctx = %d%s, block = %d, window = %d on %d of %d layers%s: the window %s\n",
        dflash_cross_ctx, params_base.speculative.dflash_cross_ctx > 0 ? "" : " (the slot context)", block, window,
        n_sliding, dflash_draft_n_layer(draft_dflash), params_base.speculative.dflash_full_attention ? " (ignored: full_attention)" : "",
        engages ? "engages" : "can never engage");
    LLAMA_LOG_INFO("dflash: the draft runs on %s\n", dflash_draft_device(draft_dflash));
    if (params_base.speculative.dflash_adaptive) {
        time_dflash_passes();
    }
    return dflash_cross_ctx;
}

// The adaptive block length weighs each token it could verify against what the extra rows add to
// the pass, which every slot's rows share: passes of up to n_parallel x (n_max + 1) rows are timed
// now. Failing that, a slot with a draft verifies n_max drafts every step; one without decodes
// one token at a time.
void server_context::time_dflash_passes() {
    const int n_rows = std::min(params_base.n_parallel * (dflash_n_max() + 1), (int) llama_n_batch(ctx));
    costs_dflash = dflash_costs_init(n_rows);
    if (costs_dflash == nullptr || dflash_costs_calibrate(costs_dflash, ctx) != 0) {
        SRV_WRN("dflash: timing the target's passes failed (%s): %s\n", dflash_last_error(),
                draft_dflash ? "every step verifies n_max drafts" : "no lookup");
        dflash_costs_free(costs_dflash);
        costs_dflash = nullptr;
        return;
    }
    std::string costs;
    for (int r = 1; r <= n_rows; ++r) {
        costs += string_format(" %.2f", dflash_costs_pass_ms(costs_dflash, r));
    }
    LLAMA_LOG_INFO("dflash: adaptive block length on (n_max %d the ceiling%s); target pass of 1..%d rows:%s ms\n",
                   dflash_n_max(), draft_dflash ? "" : ", the lookup alone", n_rows, costs.c_str());
    load_dflash = dflash_load_init(params_base.n_parallel);
}

bool server_context::init_dflash_slot(server_slot & slot, int32_t cross_ctx) {
    slot.dflash = dflash_seq_init(draft_dflash, ctx, cross_ctx, params_base.speculative.dflash_full_attention, slot.id);
    if (slot.dflash == nullptr) {
        SRV_ERR("dflash: %s\n", dflash_last_error());
        return false;
    }
    const int n_max = dflash_n_max();
    slot.dflash_block = n_max + 1;  // the most rows a step verifies
    slot.dflash_adapt = draft_dflash ? dflash_adapt_init(costs_dflash, n_max)
                                     : dflash_adapt_init_draftless(costs_dflash, n_max);
    if (slot.dflash_adapt == nullptr) {
        SRV_ERR("dflash: %s\n", dflash_last_error());
        return false;
    }
    dflash_adapt_use_confidence(slot.dflash_adapt, params_base.speculative.dflash_confidence,
                                params_base.speculative.dflash_conf_min);
    if (params_base.speculative.dflash_lookup && costs_dflash != nullptr) {
        slot.dflash_lookup = std::make_unique<ngram_lookup>(ngram_lookup::default_key_size, n_max);
    }
    SLT_INF(slot, "%s", "DFlash speculative decoding initialized\n");
    return true;
}

// The slot's proposal for its next step: up to n_draft_max_pre tokens, of which the adaptive block
// length verifies a leading part: the draft's, or the n-gram lookup's where that pays more (none
// when the draft step fails).
llama_tokens server_context::dflash_draft(server_slot & slot, int n_draft_max_pre) {
    llama_tokens looked_up;
    if (slot.dflash_lookup && n_draft_max_pre > 0) {
        const llama_tokens & tokens = slot.cache_tokens.get_text_tokens();
        looked_up.resize(n_draft_max_pre);
        looked_up.resize(slot.dflash_lookup->propose(tokens.data(), (int) tokens.size(), slot.sampled, n_draft_max_pre,
                                                     looked_up.data()));
        dflash_adapt_offer_lookup(slot.dflash_adapt, looked_up.data(), (int) looked_up.size());
    }
    // priced by what its rows add to the pass the other slots' rows are in
    const dflash_adapt_plan plan = load_dflash
        ? dflash_adapt_plan_step_in(slot.dflash_adapt, n_draft_max_pre, load_dflash, slot.id)
        : dflash_adapt_plan_step(slot.dflash_adapt, n_draft_max_pre);
    llama_tokens draft = dflash_run_draft(slot, plan.n_draft);
    if (plan.lookup) {
        draft.assign(looked_up.begin(), looked_up.begin() + plan.n_verify);  // the draft's were a probe
        log_dflash_proposal(slot, "lookup", draft, plan.n_verify);
    }
    slot.dflash_lookup_step = plan.lookup;
    if (!draft.empty() && llama_model_has_recurrent(model)) {
        // the verification pass will run the recurrent state over the drafts too
        dflash_seq_save_state(slot.dflash);
    }
    return draft;
}

// log_drafts=1: every proposal, by who made it ("drafts", "lookup"), and how many were verified.
void server_context::log_dflash_proposal(const server_slot & slot, const char * proposer, const llama_tokens & tokens,
                                         int n_verified) const {
    if (!params_base.speculative.dflash_log_drafts || tokens.empty()) {
        return;
    }
    std::string ids;
    for (llama_token t : tokens) {
        ids += " " + std::to_string(t);
    }
    SLT_INF(slot, "dflash: %s after %d at %d:%s (%d verified)\n", proposer, slot.sampled, slot.cache_tokens.pos_next(),
            ids.c_str(), n_verified);
}

// The draft's n tokens after the slot's sampled token, compared by the controller with what the
// target commits; returns those the step verifies: as many as the controller says, by their
// confidence where it cuts by it (none when the draft step fails).
llama_tokens server_context::dflash_run_draft(server_slot & slot, int n) {
    llama_tokens draft(n);
    if (n == 0) {
        return draft;
    }
    std::vector<float> confidence(dflash_adapt_wants_confidence(slot.dflash_adapt) ? n : 0);
    float * confidence_out = confidence.empty() ? nullptr : confidence.data();
    const int64_t t_start_us = ggml_time_us();
    if (dflash_seq_draft(slot.dflash, slot.sampled, slot.cache_tokens.pos_next(), n, draft.data(), confidence_out) != 0) {
        SLT_WRN(slot, "dflash: no draft: %s\n", dflash_last_error());
        return {};
    }
    if (costs_dflash) {
        dflash_costs_observe_draft(costs_dflash, n, (ggml_time_us() - t_start_us) / 1e3);
    }
    const int n_verify = dflash_adapt_proposed(slot.dflash_adapt, draft.data(), confidence_out, n);
    log_dflash_proposal(slot, "drafts", draft, n_verify);
    draft.resize(n_verify);
    return draft;
}

// DFlash: the draft's context rows of a saved slot, beside its state file (<file>.dflash).
size_t dflash_save_to_file(const std::string & filename, dflash_seq * seq) {
    dflash_cache * cache = seq ? dflash_seq_cache(seq) : nullptr;
    if (cache == nullptr) {
        return 0;  // no draft (or no DFlash): no rows
    }
    std::vector<uint8_t> state(dflash_cache_state_size(cache));
    if (dflash_cache_state_get(cache, state.data(), state.size()) == 0) {
        return 0;
    }
    std::ofstream file(filename, std::ios::binary);
    file.write(reinterpret_cast<const char *>(state.data()), state.size());
    return file.good() ? state.size() : 0;
}

// Puts back the rows saved with the slot; without them (or if they do not fit this draft) the
// draft starts from no rows, which costs acceptance but never exactness.
void dflash_load_from_file(const std::string & filename, server_slot & slot) {
    if (slot.dflash == nullptr || dflash_seq_cache(slot.dflash) == nullptr) {
        return;
    }
    std::ifstream file(filename, std::ios::binary);
    std::vector<uint8_t> state((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
    if (!file.is_open() || dflash_cache_state_set(dflash_seq_cache(slot.dflash), state.data(), state.size()) != 0) {
        SLT_WRN(slot, "dflash: no usable draft rows in %s (%s); the draft context starts empty\n", filename.c_str(),
                file.is_open() ? dflash_last_error() : "no such file");
        dflash_seq_reset(slot.dflash);
    }
}

// DFlash: give each DFlash slot the feature rows of its tokens in the decoded view, except the
// verification rows, which wait for the acceptance (dflash_accept).
void server_context::dflash_commit_view_rows(const llama_batch & view, int32_t offset) {
    for (auto & slot : slots) {
        if (slot.dflash == nullptr) {
            continue;
        }
        std::vector<int32_t> rows;
        llama_pos pos0 = 0;
        auto flush = [&]() {
            if (!rows.empty() && dflash_seq_commit(slot.dflash, capture_dflash, rows.data(), (int) rows.size(), pos0) != 0) {
                // e.g. positions that went back after a context shift: start the draft's context anew
                SLT_WRN(slot, "dflash: %s; resetting the draft context\n", dflash_last_error());
                dflash_seq_reset(slot.dflash);
            }
            rows.clear();
        };
        for (int32_t j = 0; j < view.n_tokens; ++j) {
            const bool mine = view.n_seq_id[j] > 0 && view.seq_id[j][0] == slot.id;
            const bool verifying = std::find(slot.i_batch_dft.begin(), slot.i_batch_dft.end(), offset + j) != slot.i_batch_dft.end();
            if (!mine || verifying) {
                continue;
            }
            if (!rows.empty() && view.pos[j] != pos0 + (llama_pos) rows.size()) {
                flush();
            }
            if (rows.empty()) {
                pos0 = view.pos[j];
            }
            rows.push_back(j);
        }
        flush();
    }
}

// DFlash: commit the rows of the verified token and the accepted drafts; for hybrid targets,
// queue the replay that rebuilds the recurrent state without the rejected drafts.
void server_context::dflash_accept(server_slot & slot, const std::vector<int> & view_rows, size_t n_ids,
                                   std::vector<dflash_replay> & replays) {
    const int n_keep = (int) n_ids;  // the verified token + accepted drafts have final rows
    const llama_pos pos0 = slot.cache_tokens.pos_next() - (llama_pos) (slot.drafted.size() + 1);
    const std::vector<int32_t> rows(view_rows.begin(), view_rows.begin() + n_keep);
    if (slot.dflash_lookup_step) {
        slot.n_lookup_drafted += (int32_t) slot.drafted.size();
        slot.n_lookup_accepted += n_keep - 1;
    }
    if (dflash_seq_commit(slot.dflash, capture_dflash, rows.data(), n_keep, pos0) != 0) {
        SLT_WRN(slot, "dflash: %s; resetting the draft context\n", dflash_last_error());
        dflash_seq_reset(slot.dflash);
    }
    if (llama_model_has_recurrent(model) && n_keep - 1 < (int) slot.drafted.size()) {
        dflash_replay replay{&slot, pos0, {slot.sampled}};
        replay.tokens.insert(replay.tokens.end(), slot.drafted.begin(), slot.drafted.begin() + (n_keep - 1));
        replays.push_back(std::move(replay));
        slot.dflash_replay_pending = true;
    }
}

// Hybrid targets: the recurrent state ran over rejected drafts; put back the state saved before
// the verification pass and decode the kept tokens again (after all slots sampled this batch).
void server_context::dflash_run_replays(std::vector<dflash_replay> & replays) {
    for (auto & r : replays) {
        dflash_seq_restore_state(r.slot->dflash);
        llama_kv_cache_seq_rm(ctx, r.slot->id, r.pos0, -1);
        llama_batch replay = llama_batch_init((int32_t) r.tokens.size(), 0, 1);
        for (size_t k = 0; k < r.tokens.size(); ++k) {
            common_batch_add(replay, r.tokens[k], r.pos0 + (llama_pos) k, { r.slot->id }, false);
        }
        if (capture_dflash) {
            dflash_capture_begin(capture_dflash, false);
        }
        if (llama_decode(ctx, replay) != 0) {
            SLT_ERR(*r.slot, "%s", "dflash: replaying the accepted tokens failed\n");
        }
        llama_batch_free(replay);
        r.slot->dflash_replay_pending = false;
        if (r.slot->dflash_checkpoint_pending) {
            r.slot->dflash_checkpoint_pending = false;
            create_checkpoint(*r.slot);
        }
    }
    replays.clear();
}

// DFlash: a target pass whose capture failed; its slots end with the reason, and their cached
// tokens and cells are dropped, as the pass did not compute them.
void server_context::dflash_fail_slots(const std::string & reason) {
    LOG_ERROR("dflash: the target pass failed", { {"error", reason} });
    for (auto & slot : slots) {
        if (!slot.is_processing()) {
            continue;
        }
        llama_kv_cache_seq_rm(ctx, slot.id, -1, -1);
        slot.cache_tokens.keep_first(0);
        if (slot.dflash) {
            dflash_seq_reset(slot.dflash);
        }
        slot.release();
        send_error(slot, "DFlash: " + reason, ERROR_TYPE_SERVER);
    }
}
