// The engine's sampler chain (dflash-sampler.h). The order and the meaning of each option follow
// llama.cpp's common sampler: penalties, top-k, top-p, min-p, temperature.

#include "dflash-sampler.h"
#include "dflash-impl.h"

#include <algorithm>
#include <cmath>
#include <unordered_set>

namespace dflash_impl {

namespace {

dflash_sampling checked(const dflash_sampling & p) {
    if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature)) {
        fail("temperature must be a finite number >= 0, got %g", p.temperature);
    }
    if (p.top_k < 0) {
        fail("top_k must be >= 0 (0: off), got %d", p.top_k);
    }
    if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) {
        fail("top_p must be in (0, 1] (1: off), got %g", p.top_p);
    }
    if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) {
        fail("min_p must be in [0, 1] (0: off), got %g", p.min_p);
    }
    if (!(p.repeat_penalty > 0.0f) || !std::isfinite(p.repeat_penalty)) {
        fail("repeat_penalty must be a finite number > 0 (1: off), got %g", p.repeat_penalty);
    }
    if (p.repeat_last_n < 0) {
        fail("repeat_last_n must be >= 0, got %d", p.repeat_last_n);
    }
    if (p.n_probs < 0) {
        fail("n_probs must be >= 0, got %d", p.n_probs);
    }
    return p;
}

}  // namespace

sampler::sampler(const dflash_sampling & params, int n_vocab, llama_token newline)
    : params_(checked(params)), n_vocab_(n_vocab), newline_(newline), rng_(params.seed) {}

llama_token sampler::sample(const float * logits, const std::vector<llama_token> & history) {
    const bool penalize = params_.repeat_penalty != 1.0f && params_.repeat_last_n > 0 && !history.empty();
    if (penalize) {
        // as llama.cpp: a repeated token's positive logit is divided by the penalty, a negative one
        // multiplied, once however often it occurred; the newline is spared
        penalized_.assign(logits, logits + n_vocab_);
        const size_t n = std::min(history.size(), (size_t) params_.repeat_last_n);
        std::unordered_set<llama_token> seen(history.end() - n, history.end());
        for (llama_token t : seen) {
            if (t >= 0 && t < n_vocab_ && t != newline_) {
                float & l = penalized_[t];
                l = l > 0.0f ? l / params_.repeat_penalty : l * params_.repeat_penalty;
            }
        }
        logits = penalized_.data();
    }
    if (params_.temperature <= 0.0f) {
        return (llama_token) (std::max_element(logits, logits + n_vocab_) - logits);
    }

    candidates_.resize(n_vocab_);
    for (int i = 0; i < n_vocab_; ++i) {
        candidates_[i] = {logits[i], (llama_token) i};
    }
    auto more_likely = [](const std::pair<float, llama_token> & a, const std::pair<float, llama_token> & b) {
        return a.first > b.first || (a.first == b.first && a.second < b.second);
    };
    size_t n = candidates_.size();
    if (params_.top_k > 0 && (size_t) params_.top_k < n) {
        n = params_.top_k;
        std::partial_sort(candidates_.begin(), candidates_.begin() + n, candidates_.end(), more_likely);
    } else if (params_.top_p < 1.0f) {
        std::sort(candidates_.begin(), candidates_.end(), more_likely);
    }
    float top = candidates_[0].first;
    for (size_t i = 1; i < n; ++i) {
        top = std::max(top, candidates_[i].first);
    }
    if (params_.top_p < 1.0f || params_.min_p > 0.0f) {
        // probabilities at temperature 1 over the candidates left by top-k
        weights_.resize(n);
        double sum = 0.0;
        for (size_t i = 0; i < n; ++i) {
            weights_[i] = std::exp((double) (candidates_[i].first - top));
            sum += weights_[i];
        }
        if (params_.top_p < 1.0f) {  // candidates are sorted here: keep the smallest head reaching top_p
            double mass = 0.0;
            size_t keep = 0;
            while (keep < n && (keep == 0 || mass < params_.top_p * sum)) {
                mass += weights_[keep++];
            }
            n = keep;
        }
        if (params_.min_p > 0.0f) {  // keep what is at least min_p times as likely as the most likely
            const double floor = params_.min_p;  // the top's weight is exp(0) = 1
            size_t kept = 0;
            for (size_t i = 0; i < n; ++i) {
                if (weights_[i] >= floor) {
                    candidates_[kept++] = candidates_[i];
                }
            }
            n = kept;
        }
    }
    weights_.resize(n);
    for (size_t i = 0; i < n; ++i) {
        weights_[i] = std::exp((double) (candidates_[i].first - top) / params_.temperature);
    }
    std::discrete_distribution<size_t> pick(weights_.begin(), weights_.end());
    return candidates_[pick(rng_)].second;
}

sampler::token_logprobs sampler::logprobs(const float * logits, llama_token token) const {
    const float top = *std::max_element(logits, logits + n_vocab_);
    double sum = 0.0;
    for (int i = 0; i < n_vocab_; ++i) {
        sum += std::exp((double) (logits[i] - top));
    }
    const double log_norm = top + std::log(sum);
    token_logprobs out;
    out.logprob = (float) (logits[token] - log_norm);
    const int k = std::min(params_.n_probs, n_vocab_);
    if (k > 0) {
        std::vector<llama_token> ids(n_vocab_);
        for (int i = 0; i < n_vocab_; ++i) {
            ids[i] = i;
        }
        std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](llama_token a, llama_token b) {
            return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
        });
        for (int i = 0; i < k; ++i) {
            out.top.emplace_back(ids[i], (float) (logits[ids[i]] - log_norm));
        }
    }
    return out;
}

}  // namespace dflash_impl
