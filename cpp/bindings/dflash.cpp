// _core.Draft and _core.Engine: the DFlash draft on its own (for tests and research: given
// context features, a first token and a start position, the logits of one draft step), and the
// speculative engine that drives a target with it, and its block-length controller on its own.

#include "model.h"

#include "dflash.h"
#include "dflash-measure.h"
#include "dflash-mask.h"
#include "ngram-lookup.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <memory>
#include <optional>

namespace ikdflash {

namespace {

class Draft {
public:
    Draft(Model & target, const std::string & path, int n_threads, int n_gpu_layers)
        : target_(target), path_(path), n_vocab_(target.n_vocab()) {
        dflash_draft_params params = dflash_draft_default_params();
        params.n_threads = n_threads > 0 ? n_threads : default_threads();
        params.n_gpu_layers = n_gpu_layers;
        draft_ = target.exclusive([&] { return dflash_draft_load(path.c_str(), target.raw_model(), params); });
        if (draft_ == nullptr) {
            const std::string reason = dflash_last_error();
            if (reason.find("file not found") != std::string::npos) {
                PyErr_SetString(PyExc_FileNotFoundError, reason.c_str());
                throw py::error_already_set();
            }
            throw py::value_error(reason);
        }
        target_.acquire();
    }

    ~Draft() {
        auto lock = target_.lock_busy();
        free_native();
    }

    void close() {
        if (users_ > 0) {
            throw std::runtime_error(path_ + ": cannot close the draft while " + std::to_string(users_) +
                                     " CrossContext/Engine object(s) use it: close those first");
        }
        auto lock = target_.lock_busy();
        free_native();
    }

    // As Model: cross-contexts and engines count themselves while they use this draft.
    void acquire() { ++users_; }
    void release() { --users_; }

    // Work on the draft shares its target's lock (see Model::exclusive).
    template <class Work>
    auto exclusive(Work && work) -> decltype(work()) {
        open();
        return target_.exclusive(std::forward<Work>(work));
    }

    using f32_array = py::array_t<float, py::array::c_style | py::array::forcecast>;
    using i32_array = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

    // One draft step over a fresh cross-context holding the given rows (cross_ctx 0: all of
    // them). truncate_at >= 0 then drops the rows at positions >= truncate_at, and then_features /
    // then_positions are appended after that, as a server slot does when a new request reuses
    // part of the last prompt.
    py::tuple forward(f32_array features, i32_array positions, int first_token, int start, int cross_ctx,
                      bool full_attention, int truncate_at, std::optional<f32_array> then_features,
                      std::optional<i32_array> then_positions);

    py::dict info() {
        open();
        py::dict out;
        out["format"] = dflash_draft_format(draft_);
        out["device"] = dflash_draft_device(draft_);
        out["n_layer"] = dflash_draft_n_layer(draft_);
        out["block_size"] = dflash_draft_block_size(draft_);
        out["max_proposal"] = dflash_draft_max_proposal(draft_);
        out["mask_token"] = dflash_draft_mask_token(draft_);
        out["sliding_window"] = dflash_draft_sliding_window(draft_);
        py::list sliding, causal, ids;
        for (int il = 0; il < dflash_draft_n_layer(draft_); ++il) {
            sliding.append(dflash_draft_layer_is_sliding(draft_, il));
            causal.append(dflash_draft_layer_is_causal(draft_, il));
        }
        for (int i = 0; i < dflash_draft_n_target_layers(draft_); ++i) {
            ids.append(dflash_draft_target_layer_id(draft_, i));
        }
        out["sliding"] = sliding;
        out["causal"] = causal;
        out["target_layer_ids"] = ids;
        out["n_target_features"] = dflash_draft_n_target_features(draft_);
        out["n_head_tokens"] = dflash_draft_n_head_tokens(draft_);
        out["graph_computes"] = dflash_draft_n_graph_computes(draft_);
        out["dflash2"] = settings(dflash_draft_dflash2_settings,
                                  {"conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"});
        out["dspark"] = settings(dflash_draft_dspark_settings,
                                 {"markov_rank", "confidence_width", "anchor_first", "window_from_block"});
        return out;
    }

    // A family's four settings by name, or None where the draft is not of that family.
    py::object settings(bool (*read)(const dflash_draft *, int32_t[4]), std::array<const char *, 4> names) const {
        int32_t values[4];
        if (!read(draft_, values)) {
            return py::none();
        }
        py::dict out;
        for (int i = 0; i < 4; ++i) {
            out[names[i]] = values[i];
        }
        return out;
    }

    // The number of rows, after checking the shapes of features and positions.
    int check_rows(const f32_array & features, const i32_array & positions) const {
        open();
        const int n_feat = dflash_draft_n_target_features(draft_);
        if (features.ndim() != 2 || features.shape(1) != n_feat) {
            throw py::value_error("features must have shape (rows, " + std::to_string(n_feat) + ")");
        }
        if (positions.ndim() != 1 || positions.shape(0) != features.shape(0)) {
            throw py::value_error("positions must have one entry per feature row");
        }
        return (int) features.shape(0);
    }

    // Capacity and size of a cross-context for this draft, without filling it.
    py::dict cache_layout(int cross_ctx, bool full_attention) {
        dflash_cache * cache = exclusive([&] { return dflash_cache_init(draft_, cross_ctx, full_attention); });
        if (cache == nullptr) {
            throw py::value_error(dflash_last_error());
        }
        py::list capacity;
        for (int il = 0; il < dflash_draft_n_layer(draft_); ++il) {
            capacity.append(dflash_cache_capacity(cache, il));
        }
        py::dict out;
        out["capacity"] = capacity;
        out["bytes"] = dflash_cache_size_bytes(cache);
        exclusive([&] { dflash_cache_free(cache); });
        return out;
    }

    dflash_draft * raw() const {
        open();
        return draft_;
    }
    const std::string & path() const { return path_; }
    int n_vocab() const { return n_vocab_; }
    Model & target() const { return target_; }

private:
    void open() const {
        if (draft_ == nullptr) {
            throw std::runtime_error(path_ + ": draft is closed");
        }
    }

    void free_native() {
        if (draft_ != nullptr) {
            dflash_draft_free(draft_);
            draft_ = nullptr;
            target_.release();
        }
    }

    Model & target_;   // kept alive by the binding (keep_alive), kept open by acquire()
    std::string path_;
    dflash_draft * draft_ = nullptr;
    int n_vocab_ = 0;
    int users_ = 0;
};

// _core.CrossContext: one sequence's cross-context for a draft, driven by hand (append, truncate,
// shift, save and restore its state, step), as a server slot drives it.
class CrossContext {
public:
    CrossContext(Draft & draft, int cross_ctx, bool full_attention) : draft_(draft) {
        cache_ = draft.exclusive([&] { return dflash_cache_init(draft.raw(), cross_ctx, full_attention); });
        if (cache_ == nullptr) {
            throw py::value_error(dflash_last_error());
        }
        draft_.acquire();
    }
    ~CrossContext() {
        auto lock = draft_.target().lock_busy();
        dflash_cache_free(cache_);
        draft_.release();
    }
    CrossContext(const CrossContext &) = delete;
    CrossContext & operator=(const CrossContext &) = delete;

    void append(const Draft::f32_array & features, const Draft::i32_array & positions) {
        const int n = draft_.check_rows(features, positions);
        check(draft_.exclusive([&] {
            return dflash_cache_append(draft_.raw(), cache_, features.data(), positions.data(), n);
        }));
    }

    void truncate(int pos) {
        draft_.exclusive([&] { dflash_cache_truncate(cache_, pos); });
    }

    void shift(int p0, int p1, int delta) {
        check(draft_.exclusive([&] { return dflash_cache_shift(cache_, p0, p1, delta); }));
    }

    py::bytes state() {
        std::string bytes;
        const size_t written = draft_.exclusive([&] {
            bytes.resize(dflash_cache_state_size(cache_));
            return dflash_cache_state_get(cache_, (uint8_t *) bytes.data(), bytes.size());
        });
        if (written == 0) {
            throw std::runtime_error(dflash_last_error());
        }
        return py::bytes(bytes);
    }

    void set_state(const py::bytes & state) {
        const std::string bytes = state;
        check(draft_.exclusive([&] {
            return dflash_cache_state_set(cache_, (const uint8_t *) bytes.data(), bytes.size());
        }));
    }

    // Rows held per layer (before a pending rebuild, fewer than the history holds).
    std::vector<int> n_rows() const {
        std::vector<int> out;
        for (int il = 0; il < dflash_draft_n_layer(draft_.raw()); ++il) {
            out.push_back(dflash_cache_n_rows(cache_, il));
        }
        return out;
    }

    // One draft step on [first_token, mask, ...] at start: every block row's logits, and the
    // proposals of every proposing row (rows 1.., or 0.. for an anchor-first draft).
    py::tuple step(int first_token, int start) {
        dflash_draft * d = draft_.raw();
        const int block = dflash_draft_block_size(d);
        py::array_t<float> logits({block, draft_.n_vocab()});
        std::vector<llama_token> tokens(dflash_draft_max_proposal(d));
        float * out = logits.mutable_data();
        check(draft_.exclusive([&] { return dflash_draft_step(d, cache_, first_token, start, out, tokens.data()); }));
        return py::make_tuple(logits, tokens);
    }

    // The speculative loop's step: the first n proposals only.
    std::vector<llama_token> propose(int first_token, int start, int n) {
        std::vector<llama_token> tokens(std::max(n, 0));
        check(draft_.exclusive([&] {
            return dflash_draft_propose(draft_.raw(), cache_, first_token, start, n, tokens.data(), nullptr);
        }));
        return tokens;
    }

    // The same, with each token's probability under its row's softmax: (tokens, confidences).
    py::tuple propose_with_confidence(int first_token, int start, int n) {
        std::vector<llama_token> tokens(std::max(n, 0));
        std::vector<float> confidence(std::max(n, 0));
        check(draft_.exclusive([&] {
            return dflash_draft_propose(draft_.raw(), cache_, first_token, start, n, tokens.data(), confidence.data());
        }));
        return py::make_tuple(tokens, confidence);
    }

private:
    void check(int rc) const {
        if (rc != 0) {
            throw py::value_error(draft_.path() + ": " + dflash_last_error());
        }
    }

    Draft & draft_;
    dflash_cache * cache_ = nullptr;
};

py::tuple Draft::forward(f32_array features, i32_array positions, int first_token, int start, int cross_ctx,
                         bool full_attention, int truncate_at, std::optional<f32_array> then_features,
                         std::optional<i32_array> then_positions) {
    const int n_rows = check_rows(features, positions);
    if (then_features.has_value() != then_positions.has_value()) {
        throw py::value_error("give then_features and then_positions together");
    }
    CrossContext cache(*this, cross_ctx > 0 ? cross_ctx : std::max(1, n_rows), full_attention);
    if (n_rows > 0) {
        cache.append(features, positions);
    }
    if (truncate_at >= 0) {
        cache.truncate(truncate_at);
    }
    if (then_features && then_features->shape(0) > 0) {
        cache.append(*then_features, *then_positions);
    }
    return cache.step(first_token, start);
}

// Steps by the number of drafts they verified, 0..n_max.
std::vector<int64_t> steps_by_verified(const dflash_adapt_stats & stats, int n_max) {
    const int n = std::clamp(n_max, 0, DFLASH_MAX_VERIFY);
    return std::vector<int64_t>(stats.n_steps_at, stats.n_steps_at + n + 1);
}

// The draft tokens' calibration by tenth of their predicted acceptance: (compared, kept, sum of
// predicted acceptance) for each tenth.
py::list calibration_table(const dflash_adapt_stats & stats) {
    py::list table;
    for (const auto & tenth : stats.calibration) {
        table.append(py::make_tuple(tenth.n, tenth.kept, tenth.predicted));
    }
    return table;
}

// The adaptive controller's statistics that the engine and BlockController both report.
void add_block_stats(py::dict & d, const dflash_adapt_stats & stats, int n_max) {
    d["steps_by_verified"] = steps_by_verified(stats, n_max);
    d["n_probes"] = stats.n_probes;
    d["n_lookup_steps"] = stats.n_lookup_steps;
    d["n_confidence_cut"] = stats.n_confidence_cut;
    d["calibration"] = calibration_table(stats);
}

// What a `--spec-type` value names, parsed by the runtime's own parser (the server's): None for a
// type that is not DFlash's, else "draftless" (the lookup alone) and the named keys only, so the
// caller keeps its own defaults for the rest.
py::object parse_spec_type(const std::string & text) {
    dflash_spec_options options = dflash_spec_default_options();
    uint32_t named = 0;
    const int dflash = dflash_parse_spec_type(text.c_str(), &options, &named);
    if (dflash < 0) {
        throw py::value_error(dflash_last_error());
    }
    if (dflash == 0) {
        return py::none();
    }
    py::dict out;
    out["draftless"] = options.draftless;
    if (named & DFLASH_SPEC_N_MAX) out["n_max"] = options.n_max;
    if (named & DFLASH_SPEC_N_MIN) out["n_min"] = options.n_min;
    if (named & DFLASH_SPEC_P_MIN) out["p_min"] = options.p_min;
    if (named & DFLASH_SPEC_CROSS_CTX) out["cross_ctx"] = options.cross_ctx;
    if (named & DFLASH_SPEC_FULL_ATTENTION) out["full_attention"] = options.full_attention;
    if (named & DFLASH_SPEC_LOG_DRAFTS) out["log_drafts"] = options.log_drafts;
    if (named & DFLASH_SPEC_MIN_ACCEPT) out["min_accept"] = options.min_accept;
    if (named & DFLASH_SPEC_ADAPTIVE) out["adaptive"] = options.adaptive;
    if (named & DFLASH_SPEC_LOOKUP) out["lookup"] = options.lookup;
    if (named & DFLASH_SPEC_CONFIDENCE) out["confidence"] = options.confidence;
    if (named & DFLASH_SPEC_CONF_MIN) out["conf_min"] = options.conf_min;
    return out;
}

// A confidence floor in [0, 1] (conf_min), or a ValueError.
float check_conf_min(float conf_min) {
    if (!(conf_min >= 0.0f && conf_min <= 1.0f)) {
        throw py::value_error("conf_min must be in [0, 1], got " + std::to_string(conf_min));
    }
    return conf_min;
}

// The adaptive block length's controller on pass costs given, with no model: tests drive it with
// acceptance patterns of their own. adaptive = false: the fixed block length. confidence_cut and
// conf_min: how it uses the confidences proposed() is given (dflash_adapt_use_confidence).
class BlockController {
public:
    // draft_ms: a draft step's time for 1..n_max tokens proposed (one figure: the same for all).
    BlockController(int n_max, const std::vector<double> & pass_ms, const std::vector<double> & draft_ms,
                    bool adaptive, bool confidence_cut, float conf_min) : n_max_(n_max) {
        if (n_max < 0 || n_max > DFLASH_MAX_VERIFY) {
            throw py::value_error("n_max must be in 0.." + std::to_string(DFLASH_MAX_VERIFY) + ", got " +
                                  std::to_string(n_max));
        }
        if ((int) pass_ms.size() < n_max + 1) {
            throw py::value_error("pass_ms needs the times of passes of 1.." + std::to_string(n_max + 1) +
                                  " rows at least, got " + std::to_string(pass_ms.size()));
        }
        if (draft_ms.size() != 1 && (int) draft_ms.size() != n_max) {
            throw py::value_error("draft_ms needs one time, or the times of steps proposing 1.." +
                                  std::to_string(n_max) + " tokens, got " + std::to_string(draft_ms.size()));
        }
        for (double ms : draft_ms) {
            if (!(ms > 0.0)) {
                throw py::value_error("draft_ms must be positive, got " + std::to_string(ms));
            }
        }
        costs_.reset(dflash_costs_init((int) pass_ms.size()));
        if (dflash_costs_set_passes(costs_.get(), pass_ms.data()) != 0) {
            throw py::value_error(dflash_last_error());
        }
        for (int n = 1; n <= n_max; ++n) {
            dflash_costs_observe_draft(costs_.get(), n, draft_ms[draft_ms.size() == 1 ? 0 : n - 1]);
        }
        adapt_.reset(dflash_adapt_init(adaptive ? costs_.get() : nullptr, n_max));
        dflash_adapt_use_confidence(adapt_.get(), confidence_cut, check_conf_min(conf_min));
    }

    // others: (rows, tokens, draft_ms) the other sequences of the pass add to it (a server's slots).
    // (n_draft, n_verify)
    py::tuple plan(int n_limit, std::optional<std::tuple<int, double, double>> others) {
        const dflash_adapt_plan p = plan_step(n_limit, others);
        return py::make_tuple(p.n_draft, p.n_verify);
    }

    // The same with the lookup's offer for this step: (n_draft, n_verify, whether it verifies the
    // lookup's tokens).
    py::tuple plan_offered(int n_limit, const std::vector<llama_token> & lookup,
                           std::optional<std::tuple<int, double, double>> others) {
        dflash_adapt_offer_lookup(adapt_.get(), lookup.data(), (int) lookup.size());
        const dflash_adapt_plan p = plan_step(n_limit, others);
        return py::make_tuple(p.n_draft, p.n_verify, p.lookup);
    }

    // The draft's tokens for the planned step, with their confidences or None; how many it verifies.
    int proposed(const std::vector<llama_token> & tokens, std::optional<std::vector<float>> confidence) {
        if (confidence && confidence->size() != tokens.size()) {
            throw py::value_error("confidence has " + std::to_string(confidence->size()) + " values for " +
                                  std::to_string(tokens.size()) + " tokens");
        }
        return dflash_adapt_proposed(adapt_.get(), tokens.data(), confidence ? confidence->data() : nullptr,
                                     (int) tokens.size());
    }

    void committed(int n_verified, const std::vector<llama_token> & tokens) {
        dflash_adapt_committed(adapt_.get(), n_verified, tokens.data(), (int) tokens.size());
    }

    void reset() { dflash_adapt_reset(adapt_.get()); }

    // A target pass's time, as the engine reports each one (a pass of another shape than the one
    // before rebuilt the target's graph).
    void observe_pass(int n_rows, double ms) { dflash_costs_observe_pass(costs_.get(), n_rows, ms); }

    // A draft step's time, as the engine reports each one, and what the controller now prices a
    // step proposing n_tokens at.
    void observe_draft(int n_tokens, double ms) { dflash_costs_observe_draft(costs_.get(), n_tokens, ms); }
    double draft_ms(int n_tokens) const { return dflash_costs_draft_ms(costs_.get(), n_tokens); }

    std::vector<float> acceptance(bool lookup) const {
        std::vector<float> p(n_max_);
        for (int j = 1; j <= n_max_; ++j) {
            p[j - 1] = lookup ? dflash_adapt_lookup_acceptance(adapt_.get(), j) : dflash_adapt_acceptance(adapt_.get(), j);
        }
        return p;
    }

    py::dict stats() const {
        const dflash_adapt_stats st = dflash_adapt_get_stats(adapt_.get());
        py::dict d;
        add_block_stats(d, st, n_max_);
        d["n_load_plain"] = st.n_load_plain;
        return d;
    }

private:
    dflash_adapt_plan plan_step(int n_limit, std::optional<std::tuple<int, double, double>> others) {
        if (!others) {
            return dflash_adapt_plan_step(adapt_.get(), n_limit);
        }
        std::unique_ptr<dflash_load, decltype(&dflash_load_free)> load{dflash_load_init(2), dflash_load_free};
        const auto [rows, tokens, draft_ms] = *others;
        dflash_load_set(load.get(), 1, rows, tokens, draft_ms);
        return dflash_adapt_plan_step_in(adapt_.get(), n_limit, load.get(), 0);
    }

    int n_max_;
    std::unique_ptr<dflash_costs, decltype(&dflash_costs_free)> costs_{nullptr, dflash_costs_free};
    std::unique_ptr<dflash_adapt, decltype(&dflash_adapt_free)> adapt_{nullptr, dflash_adapt_free};
};

class Engine {
public:
    Engine(Model & target, Draft * draft, int cross_ctx, bool full_attention) : target_(target), draft_(draft) {
        dflash_engine_params params{cross_ctx, full_attention};
        if (draft != nullptr) {
            draft->raw();  // raises if it is closed
        }
        engine_ = target.exclusive([&] {
            return dflash_engine_init(target.raw_context(), draft ? draft->raw() : nullptr, params);
        });
        if (engine_ == nullptr) {
            throw py::value_error(dflash_last_error());
        }
        target_.acquire();
        if (draft_ != nullptr) {
            draft_->acquire();
        }
    }

    ~Engine() {
        auto lock = target_.lock_busy();
        free_native();
    }

    void close() {
        auto lock = target_.lock_busy();
        free_native();
    }

    // lookup: the n-gram lookup's key length (0: no lookup beside the draft).
    // confidence: each draft token's calibrated confidence sets how many are verified (adaptive
    // only); conf_min: none from the first below it is.
    py::tuple generate(const std::vector<llama_token> & prompt, int max_tokens, int n_max, bool adaptive, int lookup,
                       bool confidence, float conf_min, const dflash_sampling & sampling,
                       std::optional<py::function> on_commit) {
        target_.check_tokens(prompt);
        if (max_tokens < 0) {
            throw py::value_error("max_tokens must be >= 0, got " + std::to_string(max_tokens));
        }
        if (lookup < 0) {
            throw py::value_error("lookup must be >= 0 (a key length; 0: off), got " + std::to_string(lookup));
        }
        if (sampling.n_probs < 0 || sampling.n_probs > target_.n_vocab()) {
            throw py::value_error("logprobs must be in 0.." + std::to_string(target_.n_vocab()) + ", got " +
                                  std::to_string(sampling.n_probs));
        }
        std::vector<llama_token> out(max_tokens);
        std::vector<int32_t> step_lengths(max_tokens);
        const size_t n_top = (size_t) max_tokens * sampling.n_probs;
        std::vector<float> token_logprobs(sampling.n_probs > 0 ? max_tokens : 0), top_logprobs(n_top);
        std::vector<llama_token> top_ids(n_top);
        dflash_logprobs logprobs{token_logprobs.data(), top_ids.data(), top_logprobs.data()};
        dflash_stats stats{};
        if (engine_ == nullptr) {
            throw std::runtime_error("the engine is closed");
        }
        CommitCallback callback{on_commit ? *on_commit : py::function(), nullptr};
        dflash_engine_set_commit_callback(engine_, on_commit ? &CommitCallback::call : nullptr, &callback);
        // runs as long as the controller may verify (n_max); a new one per call, as the prompt is new
        std::optional<ngram_lookup> looker;
        if (lookup > 0 && n_max > 0) {
            looker.emplace(lookup, n_max);
        }
        dflash_engine_set_lookup(engine_, looker ? looker->plug() : nullptr);
        dflash_engine_set_confidence(engine_, confidence, check_conf_min(conf_min));
        const int n = target_.exclusive([&] {
            return dflash_engine_generate(engine_, prompt.data(), (int) prompt.size(), max_tokens, n_max, adaptive,
                                          &sampling, out.data(), &stats, step_lengths.data(), &logprobs);
        });
        dflash_engine_set_commit_callback(engine_, nullptr, nullptr);
        dflash_engine_set_lookup(engine_, nullptr);
        if (callback.error) {
            std::rethrow_exception(callback.error);
        }
        if (n < 0) {
            // bad arguments are the caller's ValueError; a failed decode or capture is the run's
            if (dflash_last_error_is_argument()) {
                throw py::value_error(dflash_last_error());
            }
            throw std::runtime_error(dflash_last_error());
        }
        out.resize(n);
        py::dict st;
        st["n_prompt"] = stats.n_prompt;
        st["n_generated"] = stats.n_generated;
        st["n_drafted"] = stats.n_drafted;
        st["n_accepted"] = stats.n_accepted;
        st["n_steps"] = stats.n_steps;
        st["t_prompt_ms"] = stats.t_prompt_ms;
        st["t_draft_ms"] = stats.t_draft_ms;
        st["t_verify_ms"] = stats.t_verify_ms;
        step_lengths.resize(stats.n_steps);
        st["step_lengths"] = step_lengths;
        add_block_stats(st, stats.block, n_max);
        st["n_lookup_drafted"] = stats.n_lookup_drafted;
        st["n_lookup_accepted"] = stats.n_lookup_accepted;
        static const char * const end_reasons[] = {"length", "eog", "context", "caller"};
        st["end_reason"] = end_reasons[stats.end_reason];
        py::list per_token;  // (logprob, [(token, logprob), ...]) for each returned token
        for (int i = 0; i < n && sampling.n_probs > 0; ++i) {
            py::list top;
            for (int k = 0; k < sampling.n_probs; ++k) {
                const size_t at = (size_t) i * sampling.n_probs + k;
                top.append(py::make_tuple(top_ids[at], top_logprobs[at]));
            }
            per_token.append(py::make_tuple(token_logprobs[i], top));
        }
        return py::make_tuple(out, st, per_token);
    }

private:
    // A Python function given each step's committed tokens (GIL taken for the call): a falsy
    // result other than None stops the generation; an exception stops it and is re-raised.
    struct CommitCallback {
        py::function function;
        std::exception_ptr error;

        static bool call(const llama_token * tokens, int n_tokens, void * user_data) {
            auto * self = static_cast<CommitCallback *>(user_data);
            py::gil_scoped_acquire gil;
            try {
                py::object go_on = self->function(std::vector<llama_token>(tokens, tokens + n_tokens));
                return go_on.is_none() || go_on.cast<bool>();
            } catch (...) {
                self->error = std::current_exception();
                return false;
            }
        }
    };

    void free_native() {
        if (engine_ != nullptr) {
            dflash_engine_free(engine_);
            engine_ = nullptr;
            target_.release();
            if (draft_ != nullptr) {
                draft_->release();
            }
        }
    }

    Model & target_;
    Draft * draft_;
    dflash_engine * engine_ = nullptr;
};

// The mask rule as a float matrix (0 visible, -inf hidden), rows = padded queries.
py::array_t<float> attention_mask(std::vector<int32_t> key_positions, int start, int n_query, bool sliding,
                                  bool causal, int window, int kv_pad) {
    const dflash_mask_rule rule{sliding, causal, window};
    const int n_ctx = (int) key_positions.size();
    const int rows = dflash_mask_rows(n_query), cols = dflash_mask_cols(n_ctx + n_query, kv_pad);
    std::vector<ggml_fp16_t> half((size_t) rows * cols);
    dflash_fill_mask(half.data(), rule, key_positions.data(), n_ctx, start, n_query, kv_pad);
    py::array_t<float> out({rows, cols});
    float * data = out.mutable_data();
    for (size_t i = 0; i < half.size(); ++i) {
        data[i] = ggml_fp16_to_fp32(half[i]);
    }
    return out;
}

}  // namespace

void bind_dflash(py::module_ & m) {
    py::class_<Draft>(m, "Draft")
        .def(py::init<Model &, const std::string &, int, int>(), py::arg("target"), py::arg("path"),
             py::arg("n_threads") = 0, py::arg("n_gpu_layers") = -1, py::keep_alive<1, 2>())
        .def("close", &Draft::close)
        .def("info", &Draft::info)
        .def("cache_layout", &Draft::cache_layout, py::arg("cross_ctx"), py::arg("full_attention") = false)
        .def("forward", &Draft::forward, py::arg("features"), py::arg("positions"), py::arg("first_token"),
             py::arg("start"), py::arg("cross_ctx") = 0, py::arg("full_attention") = false,
             py::arg("truncate_at") = -1, py::arg("then_features") = py::none(), py::arg("then_positions") = py::none());
    py::class_<CrossContext>(m, "CrossContext")
        .def(py::init<Draft &, int, bool>(), py::arg("draft"), py::arg("cross_ctx"), py::arg("full_attention") = false,
             py::keep_alive<1, 2>())
        .def("append", &CrossContext::append, py::arg("features"), py::arg("positions"))
        .def("truncate", &CrossContext::truncate, py::arg("pos"))
        .def("shift", &CrossContext::shift, py::arg("p0"), py::arg("p1"), py::arg("delta"))
        .def("state", &CrossContext::state)
        .def("set_state", &CrossContext::set_state, py::arg("state"))
        .def("n_rows", &CrossContext::n_rows)
        .def("step", &CrossContext::step, py::arg("first_token"), py::arg("start"))
        .def("propose", &CrossContext::propose, py::arg("first_token"), py::arg("start"), py::arg("n"))
        .def("propose_with_confidence", &CrossContext::propose_with_confidence, py::arg("first_token"),
             py::arg("start"), py::arg("n"));
    py::class_<BlockController>(m, "BlockController")
        .def(py::init<int, const std::vector<double> &, const std::vector<double> &, bool, bool, float>(),
             py::arg("n_max"), py::arg("pass_ms"), py::arg("draft_ms"), py::arg("adaptive") = true,
             py::arg("confidence_cut") = true, py::arg("conf_min") = 0.0f)
        .def(py::init([](int n_max, const std::vector<double> & pass_ms, double draft_ms, bool adaptive,
                         bool confidence_cut, float conf_min) {
                 return BlockController(n_max, pass_ms, std::vector<double>{draft_ms}, adaptive, confidence_cut,
                                        conf_min);
             }), py::arg("n_max"), py::arg("pass_ms"), py::arg("draft_ms"), py::arg("adaptive") = true,
             py::arg("confidence_cut") = true, py::arg("conf_min") = 0.0f)
        .def("plan", &BlockController::plan, py::arg("n_limit"), py::arg("others") = py::none())
        .def("plan_offered", &BlockController::plan_offered, py::arg("n_limit"), py::arg("lookup"),
             py::arg("others") = py::none())
        .def("proposed", &BlockController::proposed, py::arg("tokens"), py::arg("confidence") = py::none())
        .def("committed", &BlockController::committed, py::arg("n_verified"), py::arg("tokens"))
        .def("reset", &BlockController::reset)
        .def("observe_pass", &BlockController::observe_pass, py::arg("n_rows"), py::arg("ms"))
        .def("observe_draft", &BlockController::observe_draft, py::arg("n_tokens"), py::arg("ms"))
        .def("draft_ms", &BlockController::draft_ms, py::arg("n_tokens"))
        .def("acceptance", &BlockController::acceptance, py::arg("lookup") = false)
        .def("stats", &BlockController::stats);
    py::class_<Engine>(m, "Engine")
        .def(py::init<Model &, Draft *, int, bool>(), py::arg("target"), py::arg("draft"), py::arg("cross_ctx"),
             py::arg("full_attention") = false, py::keep_alive<1, 2>(), py::keep_alive<1, 3>())
        .def("close", &Engine::close)
        .def("generate", [](Engine & engine, const std::vector<llama_token> & prompt, int max_tokens, int n_max,
                            bool adaptive, int lookup, bool confidence, float conf_min, float temperature, uint32_t seed,
                            int top_k, float top_p, float min_p, float repeat_penalty,
                            int repeat_last_n, int logprobs, std::optional<py::function> on_commit) {
                 dflash_sampling sampling = dflash_sampling_default();
                 sampling.temperature = temperature;
                 sampling.seed = seed;
                 sampling.top_k = top_k;
                 sampling.top_p = top_p;
                 sampling.min_p = min_p;
                 sampling.repeat_penalty = repeat_penalty;
                 sampling.repeat_last_n = repeat_last_n;
                 sampling.n_probs = logprobs;
                 return engine.generate(prompt, max_tokens, n_max, adaptive, lookup, confidence, conf_min, sampling,
                                        on_commit);
             }, py::arg("prompt"), py::arg("max_tokens"), py::arg("n_max"), py::arg("adaptive") = true,
             py::arg("lookup") = 0, py::arg("confidence") = false, py::arg("conf_min") = 0.0f,
             py::arg("temperature") = 0.0f,
             py::arg("seed") = 0, py::arg("top_k") = 0, py::arg("top_p") = 1.0f, py::arg("min_p") = 0.0f,
             py::arg("repeat_penalty") = 1.0f, py::arg("repeat_last_n") = 64, py::arg("logprobs") = 0,
             py::arg("on_commit") = py::none());
    m.def("attention_mask", &attention_mask, py::arg("key_positions"), py::arg("start"), py::arg("n_query"),
          py::arg("sliding"), py::arg("causal"), py::arg("window"), py::arg("kv_pad") = 1);
    py::class_<ngram_lookup>(m, "NgramLookup")
        .def(py::init([](int max_run, int key_size) {
                 if (max_run < 1 || key_size < 1) {
                     throw py::value_error("max_run and key_size must be >= 1, got " + std::to_string(max_run) +
                                           " and " + std::to_string(key_size));
                 }
                 return std::make_unique<ngram_lookup>(key_size, max_run);
             }), py::arg("max_run"), py::arg("key_size") = ngram_lookup::default_key_size)
        .def("propose", [](ngram_lookup & lookup, const std::vector<llama_token> & tokens, llama_token current,
                           int n_max) {
                 std::vector<llama_token> out(std::max(n_max, 0));
                 out.resize(lookup.propose(tokens.data(), (int) tokens.size(), current, n_max, out.data()));
                 return out;
             }, py::arg("tokens"), py::arg("current"), py::arg("n_max"));
    m.attr("LOOKUP_MAX_RUN") = DFLASH_LOOKUP_MAX_RUN;
    m.attr("LOOKUP_KEY_SIZE") = ngram_lookup::default_key_size;
    m.def("parse_spec_type", &parse_spec_type, py::arg("text"),
          "What a --spec-type value names, as llama-server parses it: None unless DFlash's; else draftless "
          "and the keys it names, with their values.");
}

}  // namespace ikdflash
