// ikdflash._core.training: what a draft's training data is made from. The target's layer outputs
// and next tokens at every position of a sequence (the same capture the speculative loop uses),
// and the target's own answers to many prompts, decoded side by side: a draft's best training
// data (ikdflash.train.data, kind "generated"). One sequence at a time, each token is a one-row pass
// that reads all the weights; with n_parallel sequences in every pass, those weights are read
// once for all of them. The sequences share the context's one KV cache, whose attention reads
// every sequence's cells for every row, so the gain peaks at a few sequences.

#include "model.h"

#include "dflash.h"
#include "dflash-measure.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <memory>

#include <cmath>
#include <deque>
#include <random>
#include <vector>

namespace ikdflash {

namespace {

// One sequence being answered: which prompt, how far its cache reaches, what it said so far.
struct answer_slot {
    int prompt = -1;  // index into the prompts; -1: free
    int n_past = 0;
    std::vector<llama_token> out;
    std::mt19937_64 rng;
};

// The next token from logits: their argmax at temperature 0, else a draw from softmax(logits / t).
llama_token pick(const float * logits, int n_vocab, double temperature, std::mt19937_64 & rng) {
    const float * best = std::max_element(logits, logits + n_vocab);
    if (temperature <= 0.0) {
        return (llama_token) (best - logits);
    }
    std::vector<double> weights(n_vocab);
    for (int i = 0; i < n_vocab; ++i) {
        weights[i] = std::exp((logits[i] - *best) / temperature);
    }
    return (llama_token) std::discrete_distribution<int>(weights.begin(), weights.end())(rng);
}

// Answers to prompts (each up to max_tokens, ending before an end-of-generation token), decoded
// n_parallel at a time in a context of the model's own; prompt i uses temperatures[i % size] and,
// when sampled, a generator seeded with seed + i, so the answers do not depend on n_parallel's
// grouping beyond float rounding.
std::vector<std::vector<llama_token>> generate_answers(Model & model, const std::vector<std::vector<llama_token>> & prompts,
                                                       int max_tokens, const std::vector<double> & temperatures,
                                                       uint64_t seed, int n_parallel, int n_threads) {
    if (n_parallel < 1 || max_tokens < 1 || temperatures.empty()) {
        throw py::value_error("n_parallel and max_tokens must be at least 1, and temperatures not empty");
    }
    size_t longest = 1;
    for (const auto & prompt : prompts) {
        if (prompt.empty()) {
            throw py::value_error("a prompt is empty: give at least one token");
        }
        model.check_tokens(prompt);
        longest = std::max(longest, prompt.size());
    }
    const int per_sequence = (int) longest + max_tokens;
    llama_context_params cparams = llama_context_default_params();
    cparams.n_seq_max = n_parallel;
    cparams.n_ctx = (uint32_t) n_parallel * per_sequence;
    cparams.n_batch = cparams.n_ubatch = std::max<uint32_t>(512, (uint32_t) longest + n_parallel);
    cparams.n_threads = cparams.n_threads_batch = n_threads > 0 ? n_threads : default_threads();
    cparams.batch_invariant = model.batch_invariant();
    std::vector<std::vector<llama_token>> answers(prompts.size());
    const std::string error = model.exclusive([&]() -> std::string {
        std::unique_ptr<llama_context, decltype(&llama_free)> ctx(llama_init_from_model(model.raw_model(), cparams),
                                                                  &llama_free);
        if (!ctx) {
            return "could not create a context for " + std::to_string(n_parallel) + " sequences of " +
                   std::to_string(per_sequence) + " tokens";
        }
        const llama_model * raw = model.raw_model();
        const int n_vocab = llama_n_vocab(raw);
        const int n_batch = (int) cparams.n_batch;
        llama_batch batch = llama_batch_init(n_batch, 0, 1);
        std::vector<answer_slot> slots(n_parallel);
        std::deque<int> queue;
        for (int i = 0; i < (int) prompts.size(); ++i) {
            queue.push_back(i);
        }
        std::vector<int> row_of(n_parallel);  // the batch row whose logits each slot samples from
        std::string failure;
        while (failure.empty()) {
            batch.n_tokens = 0;
            auto add = [&](llama_token t, int pos, int seq, bool logits) {
                const int r = batch.n_tokens++;
                batch.token[r] = t;
                batch.pos[r] = pos;
                batch.n_seq_id[r] = 1;
                batch.seq_id[r][0] = seq;
                batch.logits[r] = logits;
                return r;
            };
            // running sequences feed their last token; free slots take the next prompt that fits
            for (int s = 0; s < n_parallel; ++s) {
                answer_slot & slot = slots[s];
                if (slot.prompt >= 0) {
                    row_of[s] = add(slot.out.back(), slot.n_past++, s, true);
                }
            }
            for (int s = 0; s < n_parallel && !queue.empty(); ++s) {
                answer_slot & slot = slots[s];
                const auto & prompt = prompts[queue.front()];
                if (slot.prompt >= 0 || batch.n_tokens + (int) prompt.size() > n_batch) {
                    continue;
                }
                slot.prompt = queue.front();
                queue.pop_front();
                slot.n_past = 0;
                slot.out.clear();
                slot.rng.seed(seed + (uint64_t) slot.prompt);
                for (size_t j = 0; j < prompt.size(); ++j) {
                    row_of[s] = add(prompt[j], slot.n_past++, s, j + 1 == prompt.size());
                }
            }
            if (batch.n_tokens == 0) {
                break;  // every prompt answered
            }
            // A pass needs its rows' cache cells side by side; sequences that ended leave gaps, so a
            // pass that finds no run of free cells long enough packs the cache and tries again.
            int rc = llama_decode(ctx.get(), batch);
            for (int packs = 0; rc == 1 && packs < 8; ++packs) {
                llama_kv_cache_defrag(ctx.get());
                llama_kv_cache_update(ctx.get());
                rc = llama_decode(ctx.get(), batch);
            }
            if (rc != 0) {
                failure = "the target's decode failed (code " + std::to_string(rc) + ")";
                break;
            }
            for (int s = 0; s < n_parallel; ++s) {
                answer_slot & slot = slots[s];
                if (slot.prompt < 0) {
                    continue;
                }
                const float * logits = llama_get_logits_ith(ctx.get(), row_of[s]);
                const double t = temperatures[slot.prompt % temperatures.size()];
                const llama_token next = pick(logits, n_vocab, t, slot.rng);
                const bool ends = llama_token_is_eog(raw, next);
                if (!ends) {
                    slot.out.push_back(next);
                }
                if (ends || (int) slot.out.size() >= max_tokens) {
                    answers[slot.prompt] = std::move(slot.out);
                    slot.out = {};
                    slot.prompt = -1;
                    llama_kv_cache_seq_rm(ctx.get(), s, -1, -1);
                }
            }
        }
        llama_batch_free(batch);
        return failure;
    });
    if (!error.empty()) {
        throw std::runtime_error(model.path() + ": " + error);
    }
    return answers;
}

// The top_k largest logits of a row, largest first (ties: the lower id first, as the greedy
// token is chosen), written as ids and as logits less the largest (so <= 0, and exact in f16
// near the top, where it matters).
void top_logits(const float * logits, int n_vocab, int top_k, int32_t * ids, float * values) {
    int n = 0;
    for (int id = 0; id < n_vocab; ++id) {
        const float v = logits[id];
        if (n == top_k && v <= values[n - 1]) {
            continue;  // most ids stop here: one comparison each
        }
        int at = n < top_k ? n++ : top_k - 1;
        for (; at > 0 && values[at - 1] < v; --at) {
            values[at] = values[at - 1];
            ids[at] = ids[at - 1];
        }
        values[at] = v;
        ids[at] = id;
    }
    for (int i = n - 1; i >= 0; --i) {
        values[i] -= values[0];
    }
}

// The target's outputs at layer_ids for every position of tokens (one fresh pass, the KV cache
// cleared first), and the target's greedy next token at each position: the training data of a
// draft, from the same capture the speculative loop uses. No layer ids: no capture at all (the
// features have width 0), which is what the capture's cost is measured against. top_k > 0 adds
// each position's top_k next-token ids and their logits (less the row's largest), the target's
// distribution a draft can learn beside its greedy token: (features, greedy, top_ids, top_logits).
py::tuple layer_features(Model & model, const std::vector<llama_token> & tokens, const std::vector<int32_t> & layer_ids,
                         int top_k) {
    model.check_tokens(tokens);
    llama_context * ctx = model.raw_context();
    const int n = (int) tokens.size();
    if (n == 0) {
        throw py::value_error("tokens is empty: give at least one token");
    }
    if (n > (int) llama_n_ctx(ctx)) {
        throw py::value_error(std::to_string(n) + " tokens do not fit the context of " +
                              std::to_string(llama_n_ctx(ctx)) + ": load the model with a larger n_ctx");
    }
    const int width = (int) layer_ids.size() * model.n_embd();
    const int n_vocab = model.n_vocab();
    if (top_k < 0 || top_k > n_vocab) {
        throw py::value_error("top_k must lie in 0.." + std::to_string(n_vocab) + ", got " + std::to_string(top_k));
    }
    py::array_t<float> features({n, width});
    py::array_t<int32_t> greedy(n);
    py::array_t<int32_t> top_ids({n, top_k});
    py::array_t<float> top_values({n, top_k});
    float * feat = features.mutable_data();
    int32_t * next = greedy.mutable_data();
    int32_t * ids = top_ids.mutable_data();
    float * values = top_values.mutable_data();
    const std::string error = model.exclusive([&]() -> std::string {
        std::unique_ptr<dflash_capture, decltype(&dflash_capture_free)> capture(nullptr, &dflash_capture_free);
        if (!layer_ids.empty()) {
            capture.reset(dflash_capture_init_layers(ctx, layer_ids.data(), (int) layer_ids.size()));
            if (!capture) {
                throw py::value_error(dflash_last_error());  // carried out of the GIL-free region by value
            }
        }
        std::string error;
        const int n_batch = (int) llama_n_batch(ctx);
        llama_batch batch = llama_batch_init(n_batch, 0, 1);
        llama_kv_cache_clear(ctx);
        for (int i = 0; i < n && error.empty(); i += n_batch) {
            const int m = std::min(n_batch, n - i);
            dflash_batch_seq0(&batch, tokens.data() + i, m, i, true);
            if (capture) {
                dflash_capture_begin(capture.get(), true);
            }
            const int rc = llama_decode(ctx, batch);
            if (capture) {
                dflash_capture_begin(capture.get(), false);
            }
            if (rc != 0) {
                error = "the target's decode failed (code " + std::to_string(rc) + ") at position " + std::to_string(i);
            } else if (capture && (dflash_capture_check(capture.get(), m) != 0 ||
                                   dflash_capture_features(capture.get(), feat + (size_t) i * width, m) != 0)) {
                error = dflash_last_error();
            }
            for (int j = 0; j < m && error.empty(); ++j) {
                const float * logits = llama_get_logits_ith(ctx, j);
                if (top_k > 0) {  // its first is the greedy token, ties broken alike: one scan, not two
                    const size_t row = (size_t) (i + j) * top_k;
                    top_logits(logits, n_vocab, top_k, ids + row, values + row);
                    next[i + j] = ids[row];
                } else {
                    next[i + j] = (int32_t) (std::max_element(logits, logits + n_vocab) - logits);
                }
            }
        }
        llama_batch_free(batch);
        llama_kv_cache_clear(ctx);
        return error;
    });
    if (!error.empty()) {
        throw std::runtime_error(model.path() + ": " + error);
    }
    if (top_k > 0) {
        return py::make_tuple(features, greedy, top_ids, top_values);
    }
    return py::make_tuple(features, greedy);
}

}  // namespace

void bind_training(py::module_ & m) {
    m.def("layer_features", &layer_features, py::arg("model"), py::arg("tokens"), py::arg("layer_ids"),
          py::arg("top_k") = 0,
          "Target layer outputs and greedy next tokens at every position of tokens; top_k > 0 adds each\n"
          "position's top_k next-token ids and logits less the largest: (features, greedy, top_ids, top_logits).");
    m.def("generate_answers", &generate_answers, py::arg("model"), py::arg("prompts"), py::arg("max_tokens"),
          py::arg("temperatures") = std::vector<double>{0.0}, py::arg("seed") = 0, py::arg("n_parallel") = 4,
          py::arg("n_threads") = 0,
          "The target's answers to prompts, n_parallel decoded side by side (training data for a draft).");
}

}  // namespace ikdflash
