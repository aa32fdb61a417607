// The DFlash speculative loop over one target sequence (docs: dflash.md, "Verification and
// commit"). Target layer outputs are captured through the context's layer tap for every row a
// speculative generation's target processes; committed rows go to the draft's cross-context.

#include "dflash.h"
#include "dflash-measure.h"
#include "dflash-impl.h"
#include "dflash-sampler.h"

#include "ggml-backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

using dflash_impl::fail;
using dflash_impl::fail_argument;
using dflash_impl::guarded;
using dflash_impl::now_ms;

// Copies the outputs of the draft's target layers ("l_out-<il>") out of every target pass, through
// the context's layer tap: the graph keeps them as outputs and hands them over once computed.
struct dflash_capture {
    llama_context * ctx = nullptr;
    std::vector<int32_t> layer_ids;        // in the draft's order
    int n_embd = 0;
    bool active = false;
    bool failed = false;                   // the last pass handed over an output we cannot read
    std::vector<std::vector<float>> rows;  // per captured layer: n_embd floats per batch token

    ~dflash_capture() { llama_set_layer_tap(ctx, nullptr, 0, nullptr, nullptr); }

    // Called after each ubatch's compute, outputs ready; ubatches arrive in order, so appending
    // keeps rows in batch order.
    static void on_computed(void * user_data, ggml_tensor * const * outputs, int32_t n_outputs) {
        auto * self = (dflash_capture *) user_data;
        if (!self->active || self->failed) {
            return;
        }
        for (int i = 0; i < n_outputs; ++i) {
            const ggml_tensor * t = outputs[i];
            if (t == nullptr || t->type != GGML_TYPE_F32 || t->ne[0] != self->n_embd || !ggml_is_contiguous(t) ||
                dflash_fault("capture")) {
                self->failed = true;  // the caller checks (dflash_capture_check)
                return;
            }
            std::vector<float> & out = self->rows[i];
            const size_t before = out.size();
            out.resize(before + (size_t) ggml_nelements(t));
            ggml_backend_tensor_get(t, out.data() + before, 0, ggml_nbytes(t));
        }
    }

    // rows of every captured layer (a failed capture leaves the later layers short)
    int n_rows() const {
        size_t n = rows.empty() ? 0 : rows[0].size();
        for (const auto & r : rows) {
            n = std::min(n, r.size());
        }
        return n_embd == 0 ? 0 : (int) (n / n_embd);
    }

    void check(int n_tokens) const {
        if (failed) {
            fail("the target's layer outputs could not be captured (not F32 rows of width %d)", n_embd);
        }
        if (n_rows() != n_tokens) {
            fail("captured %d feature rows for %d tokens", n_rows(), n_tokens);
        }
    }

    // Feature rows (layers concatenated in the draft's order) of the given captured rows.
    void feature_rows(const int32_t * idx, int count, std::vector<float> & out) const {
        out.resize((size_t) count * n_embd * layer_ids.size());
        for (int i = 0; i < count; ++i) {
            if (idx[i] < 0 || idx[i] >= n_rows()) {
                fail("row %d was not captured (the last pass has %d rows)", idx[i], n_rows());
            }
            for (size_t k = 0; k < layer_ids.size(); ++k) {
                const float * src = rows[k].data() + (size_t) idx[i] * n_embd;
                std::copy(src, src + n_embd, out.data() + ((size_t) i * layer_ids.size() + k) * n_embd);
            }
        }
    }
};

// One recurrent layer's state row for a sequence, and the copy taken before a verification pass.
// The copy lives in the same kind of memory as the state (the GPU's when the layer is offloaded),
// so saving and restoring never cross the bus.
struct dflash_state_row {
    ggml_tensor * live = nullptr;   // view of the layer's state tensor: this sequence's row
    ggml_tensor * saved = nullptr;
    ggml_backend_buffer_t buf = nullptr;
};

struct dflash_seq {
    dflash_draft * draft = nullptr;
    dflash_cache * cache = nullptr;
    llama_seq_id seq_id = 0;
    ggml_context * state_ctx = nullptr;  // holds the views and copies below
    std::vector<dflash_state_row> state_rows;

    ~dflash_seq() {
        for (auto & r : state_rows) {
            ggml_backend_buffer_free(r.buf);
        }
        if (state_ctx) ggml_free(state_ctx);
        dflash_cache_free(cache);
    }

    void commit(const dflash_capture & capture, const int32_t * idx, int n, llama_pos pos0) {
        std::vector<float> features;
        capture.feature_rows(idx, n, features);
        std::vector<int32_t> pos(n);
        for (int i = 0; i < n; ++i) {
            pos[i] = pos0 + i;
        }
        if (dflash_cache_append(draft, cache, features.data(), pos.data(), n) != 0) {
            fail("%s", dflash_last_error());
        }
    }

    // The recurrent state tensors hold one row per sequence; only this one's is saved.
    void save_state() {
        for (auto & r : state_rows) {
            ggml_backend_tensor_copy(r.live, r.saved);
        }
    }

    void restore_state() const {
        for (const auto & r : state_rows) {
            ggml_backend_tensor_copy(r.saved, r.live);
        }
    }

    // Views of this sequence's rows of ctx's recurrent state tensors, and room for their copies.
    void bind_state_rows(llama_context * ctx) {
        const int n_layer = llama_n_layer(llama_get_model(ctx));
        ggml_init_params params = {ggml_tensor_overhead() * 2 * (size_t) std::max(1, n_layer), nullptr, /*no_alloc=*/true};
        state_ctx = ggml_init(params);
        for (int il = 0; il < n_layer; ++il) {
            ggml_tensor * s = llama_get_recurrent_state(ctx, il);
            if (s == nullptr) {
                continue;
            }
            dflash_state_row r;
            r.live = ggml_view_1d(state_ctx, s, s->ne[0], (size_t) seq_id * s->nb[1]);
            ggml_backend_view_init(r.live);
            r.saved = ggml_new_tensor_1d(state_ctx, s->type, s->ne[0]);
            r.buf = ggml_backend_buft_alloc_buffer(ggml_backend_buffer_get_type(s->buffer), ggml_nbytes(r.saved));
            if (r.buf == nullptr) {
                fail("could not allocate %zu bytes for a recurrent state snapshot", ggml_nbytes(r.saved));
            }
            ggml_backend_tensor_alloc(r.buf, r.saved, ggml_backend_buffer_get_base(r.buf));
            state_rows.push_back(r);
        }
    }
};

struct dflash_engine {
    llama_context * ctx = nullptr;
    const llama_model * model = nullptr;
    dflash_draft * draft = nullptr;
    std::unique_ptr<dflash_capture> capture;  // null without a draft
    std::unique_ptr<dflash_seq> seq;
    bool hybrid = false;
    llama_batch batch{};
    int batch_capacity = 0;

    ~dflash_engine() {
        if (batch_capacity > 0) {
            llama_batch_free(batch);
        }
    }

    // One target pass over n <= n_batch tokens at positions pos0.. on seq 0; logits for every row
    // when all_logits, else for the last; the rows' layer outputs are captured when capture_rows.
    void decode(const llama_token * tokens, int n, int pos0, bool all_logits, bool capture_rows) {
        if (n > batch_capacity) {
            if (batch_capacity > 0) {
                llama_batch_free(batch);
            }
            batch = llama_batch_init(n, 0, 1);
            batch_capacity = n;
        }
        dflash_impl::fill_seq0_batch(batch, tokens, n, pos0, all_logits);
        capture_rows = capture_rows && capture != nullptr;
        if (capture_rows) {
            dflash_capture_begin(capture.get(), true);
        }
        const int rc = llama_decode(ctx, batch);
        if (capture) {
            capture->active = false;
        }
        if (rc != 0) {
            fail("the target's decode failed with code %d at position %d", rc, pos0);
        }
        if (capture_rows) {
            capture->check(n);
        }
    }

    // Give the draft the first count rows of the last pass, at positions pos0...
    void commit_features(int count, int pos0) {
        if (capture == nullptr || count == 0) {
            return;
        }
        std::vector<int32_t> idx(count);
        for (int i = 0; i < count; ++i) {
            idx[i] = i;
        }
        seq->commit(*capture, idx.data(), count, pos0);
    }

    // The block-length controller's pass costs, timed on this context at the first adaptive
    // generation (a plain or fixed one never pays for it), then followed by every step.
    std::unique_ptr<dflash_costs, decltype(&dflash_costs_free)> costs{nullptr, dflash_costs_free};
    std::unique_ptr<dflash_adapt, decltype(&dflash_adapt_free)> adapt{nullptr, dflash_adapt_free};
    int adapt_n_max = -1;
    bool adapt_fixed = false;

    // The most rows a step's pass has: the draft's block, or without a draft the lookup's n_max
    // tokens after the current one.
    int step_rows(int n_max) const { return draft ? dflash_draft_max_proposal(draft) + 1 : n_max + 1; }

    // The controller for a generation of n_max drafts a step: fixed, or adaptive on the costs;
    // without a draft, the lookup's (adaptive).
    dflash_adapt * controller(int n_max, bool adaptive) {
        const int rows = step_rows(n_max);
        if (adaptive && (costs == nullptr || dflash_costs_max_rows(costs.get()) < rows)) {
            costs.reset(dflash_costs_init(rows));
            if (costs == nullptr || dflash_costs_calibrate(costs.get(), ctx) != 0) {
                const bool argument = dflash_last_error_is_argument();
                const std::string why = dflash_last_error();
                costs.reset();
                if (argument) {
                    fail_argument("%s", why.c_str());
                }
                fail("timing the target's passes failed: %s", why.c_str());
            }
        }
        if (adapt == nullptr || adapt_n_max != n_max || adapt_fixed != !adaptive) {
            adapt.reset(draft ? dflash_adapt_init(adaptive ? costs.get() : nullptr, n_max)
                              : dflash_adapt_init_draftless(costs.get(), n_max));
            if (adapt == nullptr) {
                fail("%s", dflash_last_error());
            }
            adapt_n_max = n_max;
            adapt_fixed = !adaptive;
        }
        dflash_adapt_reset(adapt.get());
        dflash_adapt_use_confidence(adapt.get(), confidence_cut, conf_min);
        return adapt.get();
    }

    struct generation;

    int generate(const llama_token * prompt, int n_prompt, int max_tokens, int n_max, bool adaptive,
                 const dflash_sampling & sampling, llama_token * out, dflash_stats & st, int32_t * step_lengths,
                 dflash_logprobs * logprobs);

    dflash_commit_callback on_commit = nullptr;
    void * on_commit_data = nullptr;
    const dflash_lookup * lookup = nullptr;  // offered at every adaptive step
    bool confidence_cut = false;             // adaptive steps cut drafts by their calibrated confidence
    float conf_min = 0.0f;                   // no draft from the first below this is verified
};

// One call of dflash_engine_generate, as the steps of the algorithm: prefill the prompt, then
// per step emit the current token t, plan the step, draft, verify, and emit what was accepted.
struct dflash_engine::generation {
    dflash_engine & e;
    const int n_ctx, max_tokens;
    dflash_impl::sampler smp;
    const bool want_logprobs;
    llama_token * out;
    dflash_stats & st;
    int32_t * step_lengths;
    dflash_logprobs * logprobs;
    const int n_probs;
    dflash_adapt * adapt = nullptr;   // null without a draft, and for the target alone (n_max 0)
    bool feeds_draft = false;         // the draft reads this generation's rows: captured and committed
    std::unique_ptr<dflash_spec, decltype(&dflash_spec_free)> spec{nullptr, dflash_spec_free};  // the step, on adapt
    std::vector<llama_token> history; // tokens before the position being sampled (the penalty's window)
    int n_out = 0, n_reported = 0;
    int s = 0;                        // position of t
    llama_token t = 0;                // the target's next token, not yet returned
    dflash_impl::sampler::token_logprobs t_info;
    std::vector<llama_token> proposal, verify;
    std::vector<dflash_impl::sampler::token_logprobs> row_info;  // of each verification row's sample

    using row_logprobs = dflash_impl::sampler::token_logprobs;

    generation(dflash_engine & e, int max_tokens, const dflash_sampling & sampling, llama_token * out,
               dflash_stats & st, int32_t * step_lengths, dflash_logprobs * logprobs)
        : e(e), n_ctx((int) llama_n_ctx(e.ctx)), max_tokens(max_tokens), smp(sampling, llama_n_vocab(e.model), llama_token_nl(e.model)),
          want_logprobs(logprobs != nullptr && sampling.n_probs > 0), out(out), st(st), step_lengths(step_lengths),
          logprobs(logprobs), n_probs(sampling.n_probs) {}

    // Sample row `row` of the last pass; its log-probabilities go to `info` when asked for.
    llama_token pick(int row, row_logprobs & info) {
        const float * logits = llama_get_logits_ith(e.ctx, row);
        const llama_token token = smp.sample(logits, history);
        if (want_logprobs) {
            info = smp.logprobs(logits, token);
        }
        return token;
    }

    // Return token as out[n_out], with its log-probabilities.
    void emit(llama_token token, const row_logprobs & info) {
        out[n_out] = token;
        if (want_logprobs) {
            logprobs->token[n_out] = info.logprob;
            for (size_t k = 0; k < info.top.size(); ++k) {
                logprobs->top_ids[(size_t) n_out * n_probs + k] = info.top[k].first;
                logprobs->top[(size_t) n_out * n_probs + k] = info.top[k].second;
            }
        }
        ++n_out;
    }

    // The tokens returned since the last report go to the callback; false: stop.
    bool report() {
        const bool go_on = e.on_commit == nullptr || n_out == n_reported ||
                           e.on_commit(out + n_reported, n_out - n_reported, e.on_commit_data);
        n_reported = n_out;
        return go_on;
    }

    // The prompt, a batch at a time: every row's features go to the draft (which keeps what its
    // layers can still see), so a long prompt never holds all its features at once. Samples t.
    void prefill(const llama_token * prompt, int n_prompt) {
        const double t0 = now_ms();
        history.assign(prompt, prompt + n_prompt);
        llama_kv_cache_clear(e.ctx);
        if (e.seq != nullptr) {
            dflash_seq_reset(e.seq.get());
        }
        const int n_batch = (int) llama_n_batch(e.ctx);
        for (int i = 0; i < n_prompt; i += n_batch) {
            const int m = std::min(n_batch, n_prompt - i);
            const double t_pass = now_ms();
            e.decode(prompt + i, m, i, false, feeds_draft);
            if (e.costs) {  // the controller counts a pass after one of the same shape only
                dflash_costs_observe_pass(e.costs.get(), m, now_ms() - t_pass);
            }
            if (feeds_draft) {
                e.commit_features(m, i);
            }
        }
        t = pick(-1, t_info);
        s = n_prompt;
        st.n_prompt = n_prompt;
        st.t_prompt_ms = now_ms() - t0;
    }

    // Return t; false when the generation ends here (and why, in st.end_reason).
    bool emit_current() {
        if (max_tokens <= n_out) {
            return false;
        }
        if (llama_token_is_eog(e.model, t)) {
            st.end_reason = DFLASH_END_EOG;
            return false;
        }
        emit(t, t_info);
        history.push_back(t);
        if (!report()) {
            st.end_reason = DFLASH_END_CALLER;
            return false;
        }
        if (s >= n_ctx - 1 && n_out < max_tokens) {
            st.end_reason = DFLASH_END_CONTEXT;  // t is the last token that fits
            return false;
        }
        return n_out < max_tokens;  // false after the last one asked for
    }

    // The most drafts this step may verify: bounded by n_max, the block, the context, and the
    // budget, leaving room for the target's own token so that every step's tokens are all returned.
    int draft_limit(int n_max) const {
        const int most = e.draft ? dflash_draft_max_proposal(e.draft) : DFLASH_LOOKUP_MAX_RUN;
        return std::max(0, std::min({n_max, most, max_tokens - n_out - 1, n_ctx - 2 - s}));
    }

    // This step's proposal after t (dflash_spec_propose): the draft's tokens or the lookup's, up to
    // limit. Returns how many the step verifies; whether they are the lookup's goes to from_lookup.
    int propose(int limit, bool & from_lookup) {
        proposal.resize(limit);
        dflash_proposal p;
        // history ends with t, the token whose successors are proposed
        if (dflash_spec_propose(spec.get(), history.data(), (int) history.size() - 1, t, s, limit, proposal.data(), &p) != 0) {
            fail("%s", dflash_last_error());
        }
        st.t_draft_ms += p.draft_ms;
        from_lookup = p.lookup;
        return p.n_verify;
    }

    // Verify [t, d_1..d_n] at s..s+n in one target pass; keep positions s..s+acc and undo the rest.
    // Returns acc; the target's own token after them is the new t.
    int verify_drafts(int n, bool from_lookup) {
        const double t0 = now_ms();
        verify.assign(1, t);
        verify.insert(verify.end(), proposal.begin(), proposal.begin() + n);
        e.decode(verify.data(), n + 1, s, true, feeds_draft);
        row_info.resize(n + 1);
        int acc = 0;
        llama_token next = pick(0, row_info[0]);
        while (acc < n && next == verify[acc + 1]) {
            history.push_back(next);  // the next row's sample comes after it
            ++acc;
            next = pick(acc, row_info[acc]);
        }
        if (feeds_draft) {
            e.commit_features(acc + 1, s);
        }
        if (acc < n) {
            llama_kv_cache_seq_rm(e.ctx, 0, s + acc + 1, -1);
            if (e.hybrid) {
                // the recurrent state has run past the rejected rows: restore and replay
                e.seq->restore_state();
                llama_kv_cache_seq_rm(e.ctx, 0, s, -1);
                e.decode(verify.data(), acc + 1, s, false, false);
            }
        }
        const double ms = now_ms() - t0;
        st.t_verify_ms += ms;
        if (e.costs) {
            dflash_costs_observe_pass(e.costs.get(), n + 1, ms);
        }
        // what the step committed after t: the accepted drafts and the target's own token
        verify.resize(acc + 1);
        verify.push_back(next);
        dflash_spec_accept(spec.get(), n, verify.data() + 1, acc + 1);
        if (step_lengths != nullptr) {
            step_lengths[st.n_steps] = acc + 1;
        }
        st.n_steps += 1;
        st.n_drafted += n;
        st.n_accepted += acc;
        if (from_lookup) {
            st.n_lookup_drafted += n;
            st.n_lookup_accepted += acc;
        }
        return acc;
    }

    // Return the accepted drafts; false when one ends the generation.
    bool emit_accepted(int acc) {
        for (int j = 1; j <= acc; ++j) {
            if (llama_token_is_eog(e.model, verify[j])) {
                st.end_reason = DFLASH_END_EOG;
                return false;
            }
            emit(verify[j], row_info[j - 1]);
        }
        s += acc + 1;
        t = verify[acc + 1];
        t_info = std::move(row_info[acc]);
        return true;
    }

    int run(const llama_token * prompt, int n_prompt, int n_max) {
        st = {};
        st.end_reason = DFLASH_END_LENGTH;
        prefill(prompt, n_prompt);
        while (emit_current()) {
            bool from_lookup = false;
            const int n_verify = propose(draft_limit(n_max), from_lookup);
            if (!emit_accepted(verify_drafts(n_verify, from_lookup))) {
                break;
            }
        }
        if (st.end_reason != DFLASH_END_CALLER) {
            report();  // what the last step committed before it ended the generation
        }
        if (adapt != nullptr) {
            st.block = dflash_adapt_get_stats(adapt);
        }
        st.n_generated = n_out;
        return n_out;
    }
};

int dflash_engine::generate(const llama_token * prompt, int n_prompt, int max_tokens, int n_max, bool adaptive,
                            const dflash_sampling & sampling, llama_token * out, dflash_stats & st,
                            int32_t * step_lengths, dflash_logprobs * logprobs) {
    const int n_ctx = (int) llama_n_ctx(ctx);
    if (n_prompt < 1) {
        fail_argument("the prompt is empty");
    }
    if (n_prompt >= n_ctx) {
        fail_argument("the prompt has %d tokens but the context holds %d", n_prompt, n_ctx);
    }
    if (n_max < 0) {
        fail_argument("n_max must be >= 0, got %d", n_max);
    }
    if (n_max > 0 && draft == nullptr && (lookup == nullptr || !adaptive)) {
        fail_argument("n_max %d needs a draft model, or a lookup and the adaptive block length", n_max);
    }
    if (draft == nullptr && n_max > DFLASH_LOOKUP_MAX_RUN) {
        fail_argument("n_max must be at most %d without a draft, got %d", DFLASH_LOOKUP_MAX_RUN, n_max);
    }
    if (step_rows(n_max) > (int) llama_n_batch(ctx)) {
        fail_argument(draft ? "the target's n_batch %d is smaller than the draft's block"
                            : "the target's n_batch %d is smaller than a step of n_max + 1 rows",
                      (int) llama_n_batch(ctx));
    }
    generation g(*this, max_tokens, sampling, out, st, step_lengths, logprobs);
    // n_max 0 is the target alone: on this context, so that it runs in DFlash's own memory (two
    // engines in one process decode at speeds that follow their load order), with no rows captured
    g.feeds_draft = draft != nullptr && n_max > 0;
    if (g.feeds_draft) {
        g.adapt = controller(std::min(n_max, dflash_draft_max_proposal(draft)), adaptive);
    } else if (draft == nullptr && n_max > 0) {
        g.adapt = controller(n_max, true);
    }
    g.spec.reset(dflash_spec_init(seq.get(), g.adapt, costs.get()));
    if (lookup != nullptr && g.adapt != nullptr && !adapt_fixed) {
        dflash_spec_set_lookup(g.spec.get(), lookup);
    }
    return g.run(prompt, n_prompt, n_max);
}

dflash_engine * dflash_engine_init(llama_context * target, dflash_draft * draft, dflash_engine_params params) {
    return guarded([&]() -> dflash_engine * {
        if (target == nullptr) {
            fail("no target context given");
        }
        auto e = std::make_unique<dflash_engine>();
        e->ctx = target;
        e->model = llama_get_model(target);
        e->draft = draft;
        e->hybrid = llama_model_has_recurrent(e->model);
        if (draft != nullptr || e->hybrid) {  // without a draft, for the recurrent state's snapshot
            e->seq.reset(dflash_seq_init(draft, target, params.cross_ctx, params.full_attention, 0));
            if (e->seq == nullptr) {
                fail("%s", dflash_last_error());
            }
        }
        if (draft != nullptr) {
            e->capture.reset(dflash_capture_init(target, draft));
            if (e->capture == nullptr) {
                fail("%s", dflash_last_error());
            }
        }
        return e.release();
    }, (dflash_engine *) nullptr);
}

void dflash_engine_free(dflash_engine * engine) { delete engine; }

void dflash_engine_set_commit_callback(dflash_engine * engine, dflash_commit_callback callback, void * user_data) {
    engine->on_commit = callback;
    engine->on_commit_data = user_data;
}

void dflash_engine_set_lookup(dflash_engine * engine, const dflash_lookup * lookup) { engine->lookup = lookup; }

void dflash_engine_set_confidence(dflash_engine * engine, bool calibrated_cut, float conf_min) {
    engine->confidence_cut = calibrated_cut;
    engine->conf_min = conf_min;
}

dflash_sampling dflash_sampling_default(void) {
    dflash_sampling p{};
    p.temperature = 0.0f;
    p.seed = 0;
    p.top_k = 0;
    p.top_p = 1.0f;
    p.min_p = 0.0f;
    p.repeat_penalty = 1.0f;
    p.repeat_last_n = 64;
    p.n_probs = 0;
    return p;
}

void dflash_batch_seq0(llama_batch * batch, const llama_token * tokens, int n, llama_pos pos0, bool all_logits) {
    dflash_impl::fill_seq0_batch(*batch, tokens, n, pos0, all_logits);
}

int dflash_engine_generate(dflash_engine * engine, const llama_token * prompt, int n_prompt, int max_tokens, int n_max,
                           bool adaptive, const dflash_sampling * sampling, llama_token * out, dflash_stats * stats,
                           int32_t * step_lengths, dflash_logprobs * logprobs) {
    dflash_stats local{};
    dflash_stats & st = stats ? *stats : local;
    const dflash_sampling params = sampling ? *sampling : dflash_sampling_default();
    return guarded([&]() -> int {
        return engine->generate(prompt, n_prompt, max_tokens, n_max, adaptive, params, out, st, step_lengths, logprobs);
    }, -1);
}

// --- pieces --------------------------------------------------------------------------------------

dflash_capture * dflash_capture_init(llama_context * ctx, const dflash_draft * draft) {
    std::vector<int32_t> ids;
    for (int i = 0; i < dflash_draft_n_target_layers(draft); ++i) {
        ids.push_back(dflash_draft_target_layer_id(draft, i));
    }
    return dflash_capture_init_layers(ctx, ids.data(), (int) ids.size());
}

dflash_capture * dflash_capture_init_layers(llama_context * ctx, const int32_t * layer_ids, int n_layers) {
    const int n_target_layers = llama_n_layer(llama_get_model(ctx));
    for (int i = 0; i < n_layers; ++i) {
        // the last layer's graph keeps only the rows that produce logits
        if (layer_ids[i] < 0 || layer_ids[i] >= n_target_layers - 1) {
            dflash_impl::last_error = "target layer id " + std::to_string(layer_ids[i]) + " is outside 0.." +
                                      std::to_string(n_target_layers - 2) + " (the target has " +
                                      std::to_string(n_target_layers) + " layers; the last is not captured)";
            return nullptr;
        }
    }
    // The context has one layer tap: a second capture would silently take it from the first.
    if (llama_has_layer_tap(ctx)) {
        dflash_impl::last_error = "this target context already has a DFlash capture (an engine or a feature "
                                  "capture is using it): free that first, or use another context";
        return nullptr;
    }
    auto c = std::make_unique<dflash_capture>();
    c->ctx = ctx;
    c->n_embd = llama_model_n_embd(llama_get_model(ctx));
    c->layer_ids.assign(layer_ids, layer_ids + n_layers);
    c->rows.resize(c->layer_ids.size());
    llama_set_layer_tap(ctx, c->layer_ids.data(), (int32_t) c->layer_ids.size(), dflash_capture::on_computed, c.get());
    return c.release();
}

void dflash_capture_free(dflash_capture * capture) { delete capture; }

void dflash_capture_begin(dflash_capture * capture, bool active) {
    capture->active = active;
    if (active) {
        capture->failed = false;
        for (auto & r : capture->rows) {
            r.clear();
        }
    }
}

int dflash_capture_n_rows(const dflash_capture * capture) { return capture->n_rows(); }

int dflash_capture_check(const dflash_capture * capture, int n_tokens) {
    return guarded([&]() -> int {
        capture->check(n_tokens);
        return 0;
    }, -1);
}

int dflash_capture_features(const dflash_capture * capture, float * out, int n_rows) {
    return guarded([&]() -> int {
        std::vector<int32_t> idx(n_rows);
        for (int i = 0; i < n_rows; ++i) {
            idx[i] = i;
        }
        std::vector<float> rows;
        capture->feature_rows(idx.data(), n_rows, rows);
        std::copy(rows.begin(), rows.end(), out);
        return 0;
    }, -1);
}

dflash_seq * dflash_seq_init(dflash_draft * draft, llama_context * ctx, int cross_ctx, bool full_attention,
                             llama_seq_id seq_id) {
    return guarded([&]() -> dflash_seq * {
        auto s = std::make_unique<dflash_seq>();
        s->draft = draft;
        s->seq_id = seq_id;
        if (draft != nullptr) {
            s->cache = dflash_cache_init(draft, cross_ctx, full_attention);
            if (s->cache == nullptr) {
                fail("%s", dflash_last_error());
            }
        }
        s->bind_state_rows(ctx);
        return s.release();
    }, (dflash_seq *) nullptr);
}

void dflash_seq_free(dflash_seq * seq) { delete seq; }

void dflash_seq_reset(dflash_seq * seq) { dflash_cache_clear(seq->cache); }

void dflash_seq_truncate(dflash_seq * seq, llama_pos pos) { dflash_cache_truncate(seq->cache, pos); }

dflash_cache * dflash_seq_cache(dflash_seq * seq) { return seq->cache; }

int dflash_seq_commit(dflash_seq * seq, const dflash_capture * capture, const int32_t * rows, int n_rows, llama_pos pos0) {
    return guarded([&]() -> int {
        if (seq->cache == nullptr) {
            return 0;  // no draft: nothing reads the rows
        }
        if (capture == nullptr) {
            fail("no capture to take the rows from");
        }
        seq->commit(*capture, rows, n_rows, pos0);
        return 0;
    }, -1);
}

int dflash_seq_draft(dflash_seq * seq, llama_token t, llama_pos pos, int n, llama_token * out, float * confidence) {
    if (seq->draft == nullptr) {
        dflash_impl::last_error = "this sequence has no draft";
        return -1;
    }
    const int most = dflash_draft_max_proposal(seq->draft);
    if (n < 0 || n > most) {
        dflash_impl::last_error = "draft length " + std::to_string(n) + " outside 0.." + std::to_string(most);
        return -1;
    }
    return n == 0 ? 0 : dflash_draft_propose(seq->draft, seq->cache, t, pos, n, out, confidence);
}

void dflash_seq_save_state(dflash_seq * seq) { seq->save_state(); }

void dflash_seq_restore_state(const dflash_seq * seq) { seq->restore_state(); }
