// The target's own answers to many prompts, decoded side by side: a draft's best training data
// (ikdflash.train.data, kind "generated"). One sequence at a time, each token is a one-row pass
// that reads all the weights; with n_parallel sequences in every pass, those weights are read
// once for all of them. The sequences share the context's one KV cache, whose attention reads
// every sequence's cells for every row, so the gain peaks at a few sequences.

#include "model.h"

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

}  // namespace

void bind_answers(py::module_ & m) {
    m.def("generate_answers", &generate_answers, py::arg("model"), py::arg("prompts"), py::arg("max_tokens"),
          py::arg("temperatures") = std::vector<double>{0.0}, py::arg("seed") = 0, py::arg("n_parallel") = 4,
          py::arg("n_threads") = 0,
          "The target's answers to prompts, n_parallel decoded side by side (training data for a draft).");
}

}  // namespace ikdflash
