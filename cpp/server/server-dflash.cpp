// llama-server's DFlash speculative decoding and n-gram lookup (server-dflash.h), compiled into
// llama-server from this repository.

#include "server-dflash.h"

#include "server-common.h"
#include "server-context.h"

#include "common.h"
#include "llama.h"
#include "log.h"

#include <algorithm>
#include <fstream>
#include <iterator>

namespace {

const dflash_spec_options & options(const server_context & server) {
    return server.params_base.speculative.dflash;
}

// The most tokens a slot's step verifies: n_max, bounded by what one draft pass proposes, or
// without a draft by DFLASH_LOOKUP_MAX_RUN.
int n_max(const server_context & server) {
    const int most = server.dflash.draft ? dflash_draft_max_proposal(server.dflash.draft) : DFLASH_LOOKUP_MAX_RUN;
    return std::min(server.params_base.speculative.n_max, most);
}

// Every slot's verification rows (the sampled token and its drafts) share one batch.
bool rows_fit_the_batch(const server_context & server) {
    const int n_rows_slot = n_max(server) + 1;
    const int64_t n_batch = llama_n_batch(server.ctx);
    if ((int64_t) server.params_base.n_parallel * n_rows_slot <= n_batch) {
        return true;
    }
    LOG_ERROR("DFlash: the verification rows do not fit the batch", {
        {"error", std::to_string(server.params_base.n_parallel) + " slots x " + std::to_string(n_rows_slot) +
                  " rows (n_max + 1) exceed --batch-size " + std::to_string(n_batch) +
                  "; raise --batch-size or lower --parallel or n_max"} });
    return false;
}

// The adaptive block length weighs each token it could verify against what the extra rows add to
// the pass, which every slot's rows share: passes of up to n_parallel x (n_max + 1) rows are timed
// now. Failing that, a slot with a draft verifies n_max drafts every step; one without decodes
// one token at a time.
void time_passes(server_context & server) {
    server_dflash & d = server.dflash;
    const int n_rows = std::min(server.params_base.n_parallel * (n_max(server) + 1), (int) llama_n_batch(server.ctx));
    d.costs = dflash_costs_init(n_rows);
    if (d.costs == nullptr || dflash_costs_calibrate(d.costs, server.ctx) != 0) {
        SRV_WRN("dflash: timing the target's passes failed (%s): %s\n", dflash_last_error(),
                d.draft ? "every step verifies n_max drafts" : "no lookup");
        dflash_costs_free(d.costs);
        d.costs = nullptr;
        return;
    }
    std::string costs;
    for (int r = 1; r <= n_rows; ++r) {
        costs += string_format(" %.2f", dflash_costs_pass_ms(d.costs, r));
    }
    LLAMA_LOG_INFO("dflash: adaptive block length on (n_max %d the ceiling%s); target pass of 1..%d rows:%s ms; "
                   "a graph rebuild %.2f ms\n",
                   n_max(server), d.draft ? "" : ", the lookup alone", n_rows, costs.c_str(),
                   dflash_costs_rebuild_ms(d.costs));
    d.load = dflash_load_init(server.params_base.n_parallel);
}

// Any failure of the draft's context rows costs acceptance, never exactness: they start anew.
void reset_on_failure(server_slot & slot, int status) {
    if (status != 0) {
        SLT_WRN(slot, "dflash: %s; resetting the draft context\n", dflash_last_error());
        dflash_seq_reset(slot.dflash.seq);
    }
}

// log_drafts=1: every proposal, by who made it ("drafts", "lookup"), and how many were verified.
void log_proposal(const server_context & server, const server_slot & slot, const char * proposer,
                  const llama_token * tokens, int n_tokens, int n_verified) {
    if (!options(server).log_drafts || n_tokens == 0) {
        return;
    }
    std::string ids;
    for (int i = 0; i < n_tokens; ++i) {
        ids += " " + std::to_string(tokens[i]);
    }
    SLT_INF(slot, "dflash: %s after %d at %d:%s (%d verified)\n", proposer, slot.sampled, slot.cache_tokens.pos_next(),
            ids.c_str(), n_verified);
}

// A target pass whose capture failed: its slots end with the reason, and their cached tokens and
// cells are dropped, as the pass did not compute them.
void fail_slots(server_context & server, const std::string & reason) {
    LOG_ERROR("dflash: the target pass failed", { {"error", reason} });
    for (auto & slot : server.slots) {
        if (!slot.is_processing()) {
            continue;
        }
        llama_kv_cache_seq_rm(server.ctx, slot.id, -1, -1);
        slot.cache_tokens.keep_first(0);
        dflash_slot_forget(slot);
        slot.release();
        server.send_error(slot, "DFlash: " + reason, ERROR_TYPE_SERVER);
    }
}

// Each DFlash slot's feature rows of its tokens in the decoded view, except the verification
// rows, which wait for the verification's outcome (speculation_verified).
void commit_view_rows(server_context & server, const llama_batch & view, int32_t offset) {
    for (auto & slot : server.slots) {
        if (!slot.dflash) {
            continue;
        }
        std::vector<int32_t> rows;
        llama_pos pos0 = 0;
        auto flush = [&]() {
            if (!rows.empty()) {
                // e.g. positions that went back after a context shift
                reset_on_failure(slot, dflash_seq_commit(slot.dflash.seq, server.dflash.capture, rows.data(),
                                                         (int) rows.size(), pos0));
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

}  // namespace

// --- the server ---------------------------------------------------------------------------------

bool dflash_server_load(server_context & server) {
    if (server.params_base.speculative.type != COMMON_SPECULATIVE_TYPE_DFLASH) {
        return true;
    }
    dflash_spec_options & opts = server.params_base.speculative.dflash;
    const std::string & draft_path = server.params_base.speculative.model;
    if (!server.params_base.mmproj.path.empty()) {
        LOG_ERROR("--spec-type dflash is not supported with a multimodal projector", {});
        return false;
    }
    if (opts.draftless) {
        if (!draft_path.empty()) {
            LOG_ERROR("--spec-type lookup takes no draft: with --model-draft, use --spec-type dflash", {});
            return false;
        }
        return rows_fit_the_batch(server);
    }
    if (draft_path.empty()) {
        LOG_ERROR("--spec-type dflash needs the DFlash draft: pass it with --model-draft", {});
        return false;
    }
    dflash_draft_params dparams = dflash_draft_default_params();
    dparams.n_threads = server.params_base.n_threads;
    dparams.n_gpu_layers = server.params_base.speculative.n_gpu_layers;  // -ngld; default -1: like the target
    server.dflash.draft = dflash_draft_load(draft_path.c_str(), server.model, dparams);
    if (server.dflash.draft == nullptr) {
        LOG_ERROR("failed to load the DFlash draft", { {"error", dflash_last_error()} });
        return false;
    }
    if (!rows_fit_the_batch(server)) {
        return false;
    }
    // the draft's history: -cd (--ctx-size-draft), as upstream sets a DFlash draft's, or
    // cross_ctx; both only when they agree
    const int32_t ctx_draft = server.params_base.speculative.n_ctx;
    if (opts.cross_ctx > 0 && ctx_draft > 0 && opts.cross_ctx != ctx_draft) {
        LOG_ERROR("DFlash: two lengths for the draft's history", {
            {"error", "--spec-type dflash:cross_ctx=" + std::to_string(opts.cross_ctx) + " and -cd " +
                      std::to_string(ctx_draft) + " disagree; give one of them"} });
        return false;
    }
    if (ctx_draft > 0) {
        opts.cross_ctx = ctx_draft;
    }
    return true;
}

void dflash_server_init(server_context & server, int32_t n_ctx_slot) {
    if (!dflash_server_active(server)) {
        return;
    }
    const dflash_spec_options & opts = options(server);
    server_dflash & d = server.dflash;
    d.cross_ctx = opts.cross_ctx > 0 ? opts.cross_ctx : n_ctx_slot;
    if (d.draft == nullptr) {  // the lookup alone
        time_passes(server);
        return;
    }
    d.capture = dflash_capture_init(server.ctx, d.draft);
    const int window = dflash_draft_sliding_window(d.draft);
    const int block = dflash_draft_block_size(d.draft);
    int n_sliding = 0;
    for (int il = 0; il < dflash_draft_n_layer(d.draft); ++il) {
        n_sliding += dflash_draft_layer_is_sliding(d.draft, il);
    }
    // the window hides context rows only once more than window - block rows are kept
    const bool engages = n_sliding > 0 && !opts.full_attention && d.cross_ctx > window - block;
    LLAMA_LOG_INFO("dflash: cross_ctx = %d%s, block = %d, window = %d on %d of %d layers%s: the window %s\n",
        d.cross_ctx, opts.cross_ctx > 0 ? "" : " (the slot context)", block, window,
        n_sliding, dflash_draft_n_layer(d.draft), opts.full_attention ? " (ignored: full_attention)" : "",
        engages ? "engages" : "can never engage");
    LLAMA_LOG_INFO("dflash: the draft runs on %s\n", dflash_draft_device(d.draft));
    if (opts.adaptive) {
        time_passes(server);
    }
}

bool dflash_server_active(const server_context & server) {
    return server.dflash.draft != nullptr || (server.params_base.speculative.type == COMMON_SPECULATIVE_TYPE_DFLASH &&
                                              options(server).draftless);
}

void dflash_server_free(server_context & server) {
    // the slots first, then the capture, which gives the context its eval callback back
    for (server_slot & slot : server.slots) {
        dflash_spec_free(slot.dflash.spec);
        dflash_seq_free(slot.dflash.seq);
        dflash_adapt_free(slot.dflash.adapt);
        slot.dflash = server_dflash_slot{};
    }
    server_dflash & d = server.dflash;
    if (d.capture) {
        dflash_capture_free(d.capture);
    }
    dflash_costs_free(d.costs);
    dflash_load_free(d.load);
    dflash_draft_free(d.draft);
    d = server_dflash{};
}

size_t dflash_state_seq_set_data(llama_context * ctx, const uint8_t * src, size_t size, llama_seq_id seq) {
    if (dflash_fault("prompt_restore")) {
        llama_kv_cache_seq_rm(ctx, seq, -1, -1);
        return 0;
    }
    return llama_state_seq_set_data(ctx, src, size, seq, 0);
}

// --- a slot's life ------------------------------------------------------------------------------

bool dflash_slot_init(server_context & server, server_slot & slot) {
    const dflash_spec_options & opts = options(server);
    server_dflash & d = server.dflash;
    server_dflash_slot & s = slot.dflash;
    s.seq = dflash_seq_init(d.draft, server.ctx, d.cross_ctx, opts.full_attention, slot.id);
    if (s.seq == nullptr) {
        SRV_ERR("dflash: %s\n", dflash_last_error());
        return false;
    }
    s.n_max = n_max(server);
    s.adapt = d.draft ? dflash_adapt_init(d.costs, s.n_max) : dflash_adapt_init_draftless(d.costs, s.n_max);
    if (s.adapt == nullptr) {
        SRV_ERR("dflash: %s\n", dflash_last_error());
        return false;
    }
    dflash_adapt_use_confidence(s.adapt, opts.confidence, opts.conf_min);
    s.spec = dflash_spec_init(s.seq, s.adapt, d.costs);
    if (d.load) {
        dflash_spec_set_load(s.spec, d.load, slot.id);
    }
    if (opts.lookup && d.costs != nullptr) {
        s.lookup = std::make_unique<ngram_lookup>(ngram_lookup::default_key_size, s.n_max);
        dflash_spec_set_lookup(s.spec, s.lookup->plug());
    }
    SLT_INF(slot, "%s", "DFlash speculative decoding initialized\n");
    return true;
}

void dflash_slot_forget(server_slot & slot) {
    if (slot.dflash) {
        dflash_seq_reset(slot.dflash.seq);
    }
}

void dflash_slot_save_prompt(const server_slot & slot, server_prompt & prompt) {
    dflash_cache * cache = slot.dflash ? dflash_seq_cache(slot.dflash.seq) : nullptr;
    if (cache != nullptr) {
        prompt.dflash_state.resize(dflash_cache_state_size(cache));
        dflash_cache_state_get(cache, prompt.dflash_state.data(), prompt.dflash_state.size());
    }
}

void dflash_slot_load_prompt(server_slot & slot, bool restored) {
    std::vector<uint8_t> state = std::move(slot.server_cached_prompt.dflash_state);
    slot.server_cached_prompt.dflash_state.clear();  // the slot's own rows are in its seq
    if (!slot.dflash) {
        return;
    }
    if (!restored) {
        dflash_seq_reset(slot.dflash.seq);  // the failed restore emptied the target's cells
    } else if (!state.empty()) {
        // another prompt came out of the cache: so do its draft rows
        reset_on_failure(slot, dflash_cache_state_set(dflash_seq_cache(slot.dflash.seq), state.data(), state.size()));
    }
}

size_t dflash_slot_save_file(const server_slot & slot, const std::string & filename) {
    dflash_cache * cache = slot.dflash ? dflash_seq_cache(slot.dflash.seq) : nullptr;
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

// Without the saved rows (or if they do not fit this draft) the draft starts from no rows, which
// costs acceptance but never exactness.
void dflash_slot_load_file(server_slot & slot, const std::string & filename) {
    if (!slot.dflash || dflash_seq_cache(slot.dflash.seq) == nullptr) {
        return;
    }
    std::ifstream file(filename, std::ios::binary);
    std::vector<uint8_t> state((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
    if (!file.is_open() || dflash_cache_state_set(dflash_seq_cache(slot.dflash.seq), state.data(), state.size()) != 0) {
        SLT_WRN(slot, "dflash: no usable draft rows in %s (%s); the draft context starts empty\n", filename.c_str(),
                file.is_open() ? dflash_last_error() : "no such file");
        dflash_seq_reset(slot.dflash.seq);
    }
}

void dflash_slot_shift(server_slot & slot, llama_pos p0, llama_pos p1, llama_pos delta) {
    if (!slot.dflash) {
        return;
    }
    const int status = dflash_cache_shift(dflash_seq_cache(slot.dflash.seq), p0, p1, delta);
    reset_on_failure(slot, status);
    if (status == 0) {
        SLT_INF(slot, "dflash: context shift: the draft drops its rows at [%d, %d) and moves the later ones by %d\n",
                p0, p1, delta);
    }
}

void dflash_slot_truncate(server_slot & slot, llama_pos pos, bool prompt_reuse) {
    if (!slot.dflash) {
        return;
    }
    dflash_seq_truncate(slot.dflash.seq, pos);
    if (prompt_reuse && slot.dflash.logged_task != slot.id_task) {
        slot.dflash.logged_task = slot.id_task;
        SLT_INF(slot, "dflash: the draft keeps its context rows before position %d\n", pos);
    }
}

bool dflash_slot_defer_checkpoint(server_slot & slot) {
    // the recurrent state still holds the rejected drafts: checkpoint it once replayed
    slot.dflash.checkpoint_pending = slot.dflash.replay_pending;
    return slot.dflash.checkpoint_pending;
}

// --- a step ---------------------------------------------------------------------------------------

void dflash_slot_rows(server_context & server, const server_slot & slot, int n_rows) {
    if (server.dflash.load) {
        dflash_load_set(server.dflash.load, slot.id, n_rows, n_rows, 0.0);
    }
}

llama_tokens dflash_slot_draft(server_context & server, server_slot & slot, int n_draft_max) {
    llama_tokens draft(std::max(n_draft_max, 0));
    const llama_tokens & tokens = slot.cache_tokens.get_text_tokens();
    dflash_proposal p;
    if (dflash_spec_propose(slot.dflash.spec, tokens.data(), (int) tokens.size(), slot.sampled, slot.cache_tokens.pos_next(),
                            n_draft_max, draft.data(), &p) != 0) {
        SLT_WRN(slot, "dflash: no draft: %s\n", dflash_last_error());
        return {};
    }
    log_proposal(server, slot, "drafts", p.drafted, p.n_drafted, p.lookup ? 0 : p.n_verify);
    if (p.lookup) {
        log_proposal(server, slot, "lookup", draft.data(), p.n_verify, p.n_verify);
    }
    slot.dflash.lookup_step = p.lookup;
    draft.resize(p.n_verify);
    return draft;
}

int64_t dflash_view_begin(server_context & server) {
    if (server.dflash.capture) {
        dflash_capture_begin(server.dflash.capture, true);
    }
    return ggml_time_us();
}

bool dflash_view_decoded(server_context & server, const llama_batch & view, int32_t offset, int64_t t_start_us) {
    // the verification's cost, for each slot whose drafts this view carried
    const double view_ms = (ggml_time_us() - t_start_us) / 1e3;
    if (server.dflash.costs) {
        dflash_costs_observe_pass(server.dflash.costs, view.n_tokens, view_ms);  // only counts it knows are kept
    }
    for (auto & slot : server.slots) {
        if (slot.state == SLOT_STATE_PROCESSING && !slot.i_batch_dft.empty() &&
            slot.i_batch_dft.front() >= offset && slot.i_batch_dft.back() < offset + view.n_tokens) {
            slot.spec_counts.t_verify_ms += view_ms;
        }
    }
    if (server.dflash.capture == nullptr) {
        return true;
    }
    if (dflash_capture_check(server.dflash.capture, view.n_tokens) != 0) {
        // the pass stopped at the capture: its logits and cells are not the target's
        fail_slots(server, dflash_last_error());
        return false;
    }
    commit_view_rows(server, view, offset);
    return true;
}

void speculation_verified(server_context & server, server_slot & slot, const std::vector<int> & view_rows,
                          const llama_tokens & ids, std::vector<dflash_replay> & replays) {
    const int n_drafted = (int) slot.drafted.size();
    const int n_keep = (int) ids.size();  // the verified token + accepted drafts have final rows
    server_dflash_slot & s = slot.dflash;
    if (s) {
        const llama_pos pos0 = slot.cache_tokens.pos_next() - (llama_pos) (n_drafted + 1);
        const std::vector<int32_t> rows(view_rows.begin(), view_rows.begin() + n_keep);
        if (s.lookup_step) {
            slot.spec_counts.n_lookup_drafted += n_drafted;
            slot.spec_counts.n_lookup_accepted += n_keep - 1;
        }
        reset_on_failure(slot, dflash_seq_commit(s.seq, server.dflash.capture, rows.data(), n_keep, pos0));
        if (llama_model_has_recurrent(server.model) && n_keep - 1 < n_drafted) {
            dflash_replay replay{&slot, pos0, {slot.sampled}};
            replay.tokens.insert(replay.tokens.end(), slot.drafted.begin(), slot.drafted.begin() + (n_keep - 1));
            replays.push_back(std::move(replay));
            s.replay_pending = true;
        }
        dflash_spec_accept(s.spec, n_drafted, ids.data(), n_keep);
    }
    speculation_note_step(slot, n_drafted, n_keep - 1, options(server).min_accept);
}

// Hybrid targets: the recurrent state ran over rejected drafts; the state saved before the
// verification pass is put back and the kept tokens are decoded again.
void dflash_run_replays(server_context & server, std::vector<dflash_replay> & replays) {
    for (auto & r : replays) {
        server_slot & slot = *r.slot;
        dflash_seq_restore_state(slot.dflash.seq);
        llama_kv_cache_seq_rm(server.ctx, slot.id, r.pos0, -1);
        llama_batch replay = llama_batch_init((int32_t) r.tokens.size(), 0, 1);
        for (size_t k = 0; k < r.tokens.size(); ++k) {
            common_batch_add(replay, r.tokens[k], r.pos0 + (llama_pos) k, { slot.id }, false);
        }
        if (server.dflash.capture) {
            dflash_capture_begin(server.dflash.capture, false);
        }
        if (llama_decode(server.ctx, replay) != 0) {
            SLT_ERR(slot, "%s", "dflash: replaying the accepted tokens failed\n");
        }
        llama_batch_free(replay);
        slot.dflash.replay_pending = false;
        if (slot.dflash.checkpoint_pending) {
            slot.dflash.checkpoint_pending = false;
            server.create_checkpoint(slot);
        }
    }
    replays.clear();
}

void dflash_slot_decoded_one(server_slot & slot, llama_token id) {
    if (slot.dflash && slot.n_decoded > 1) {
        dflash_spec_accept(slot.dflash.spec, 0, &id, 1);  // a step that verified no drafts
    }
}
