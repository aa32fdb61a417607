// How the engine's target picks a token at a position: one chain, the same for every position,
// drafted or not (so a draft token is kept exactly when it equals what the target alone would
// have picked there), and the log-probabilities of what it picked.

#pragma once

#include "dflash.h"

#include <random>
#include <utility>
#include <vector>

namespace dflash_impl {

class sampler {
public:
    // newline: the vocabulary's newline token, which the repetition penalty spares (as
    // llama-server does unless a request asks for penalize_nl); -1 for none.
    sampler(const dflash_sampling & params, int n_vocab, llama_token newline);

    // The token for the position after `history` (prompt and tokens so far), from its logits:
    // repetition penalty over the last repeat_last_n tokens of history, then greedy at
    // temperature 0, else top-k, top-p and min-p on the probabilities at temperature 1, then the
    // temperature, then one draw of the seeded generator.
    llama_token sample(const float * logits, const std::vector<llama_token> & history);

    // Log-softmax of the raw logits: the token's log-probability and the n_probs most likely
    // tokens with theirs, most likely first.
    struct token_logprobs {
        float logprob = 0.0f;
        std::vector<std::pair<llama_token, float>> top;
    };
    token_logprobs logprobs(const float * logits, llama_token token) const;

private:
    dflash_sampling params_;
    int n_vocab_;
    llama_token newline_;
    std::mt19937 rng_;
    std::vector<float> penalized_;
    std::vector<std::pair<float, llama_token>> candidates_;  // (logit, token)
    std::vector<double> weights_;
};

}  // namespace dflash_impl
