#include "ngram-lookup.h"

#include "ngram-map.h"

#include <algorithm>
#include <vector>

struct ngram_lookup::state {
    int key_size, max_run;
    common_ngram_map map;
    llama_tokens seen;  // the sequence the map was built over, less its current token
    llama_tokens run;

    state(int key_size, int max_run)
        : key_size(key_size), max_run(max_run), map((uint16_t) key_size, (uint16_t) max_run, /*only_keys=*/true, 1) {}

    // The map indexes positions of `seen`: anything but an extension of it invalidates them.
    void follow(const llama_token * tokens, int n) {
        const bool extends = (size_t) n >= seen.size() && std::equal(seen.begin(), seen.end(), tokens);
        if (!extends) {
            map = common_ngram_map((uint16_t) key_size, (uint16_t) max_run, /*only_keys=*/true, 1);
            seen.assign(tokens, tokens + n);
            common_ngram_map_begin(map, seen);
            return;
        }
        seen.insert(seen.end(), tokens + seen.size(), tokens + n);
    }
};

ngram_lookup::ngram_lookup(int key_size, int max_run)
    : state_(std::make_unique<state>(std::max(key_size, 1), std::max(max_run, 1))) {
    plug_.state = this;
    plug_.propose = [](void * self, const llama_token * tokens, int n_tokens, int n_max, llama_token * out) {
        if (n_tokens < 1) {
            return 0;
        }
        return static_cast<ngram_lookup *>(self)->propose(tokens, n_tokens - 1, tokens[n_tokens - 1], n_max, out);
    };
}

ngram_lookup::~ngram_lookup() = default;

int ngram_lookup::propose(const llama_token * tokens, int n_tokens, llama_token current, int n_max, llama_token * out) {
    if (n_max < 1) {
        return 0;
    }
    state_->follow(tokens, n_tokens);
    state_->run.clear();
    common_ngram_map_draft(state_->map, state_->seen, current, state_->run);
    const int n = std::min(n_max, (int) state_->run.size());
    std::copy(state_->run.begin(), state_->run.begin() + n, out);
    return n;
}
