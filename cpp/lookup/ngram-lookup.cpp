#include "ngram-lookup.h"

#include "ngram-map.h"

#include <algorithm>
#include <vector>

namespace {
// A map proposes only where the whole run it was made for follows the key, so a run of max_run
// tokens is not found in a repeat shorter than key + max_run + 1 tokens; a second map for runs
// this long finds those.
constexpr int k_short_run = 4;
}  // namespace

struct ngram_lookup::state {
    int key_size;
    std::vector<int> runs;              // each map's run, longest first
    std::vector<common_ngram_map> maps;
    llama_tokens seen;                  // the sequence the maps index, less its current token
    llama_tokens run;

    void start(const llama_token * tokens, int n) {
        seen.assign(tokens, tokens + n);
        maps.clear();
        for (int length : runs) {
            maps.emplace_back((uint16_t) key_size, (uint16_t) length, /*only_keys=*/true, 1);
            common_ngram_map_begin(maps.back(), seen);
        }
    }

    // The maps index positions of `seen`: anything but an extension of it (a new request) starts
    // them anew.
    void follow(const llama_token * tokens, int n) {
        const bool extends = !maps.empty() && (size_t) n >= seen.size() && std::equal(seen.begin(), seen.end(), tokens);
        if (!extends) {
            start(tokens, n);
            return;
        }
        seen.insert(seen.end(), tokens + seen.size(), tokens + n);
    }
};

ngram_lookup::ngram_lookup(int key_size, int max_run) : state_(std::make_unique<state>()) {
    state_->key_size = std::max(key_size, 1);
    state_->runs.push_back(std::max(max_run, 1));
    if (max_run > k_short_run) {
        state_->runs.push_back(k_short_run);
    }
    plug_.state = this;
    plug_.propose = [](void * self, const llama_token * tokens, int n_tokens, llama_token current, int n_max,
                       llama_token * out) {
        return static_cast<ngram_lookup *>(self)->propose(tokens, n_tokens, current, n_max, out);
    };
}

ngram_lookup::~ngram_lookup() = default;

int ngram_lookup::propose(const llama_token * tokens, int n_tokens, llama_token current, int n_max, llama_token * out) {
    if (n_max < 1) {
        return 0;
    }
    state_->follow(tokens, n_tokens);
    for (common_ngram_map & map : state_->maps) {
        state_->run.clear();
        common_ngram_map_draft(map, state_->seen, current, state_->run);
        if (!state_->run.empty()) {
            break;
        }
    }
    const int n = std::min(n_max, (int) state_->run.size());
    std::copy(state_->run.begin(), state_->run.begin() + n, out);
    return n;
}
