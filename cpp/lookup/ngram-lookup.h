// The n-gram lookup beside the DFlash draft: the base's n-gram map (common/ngram-map.h, as its
// ngram-map-k) over the prompt and the reply so far, as the dflash_lookup a controller is offered
// (dflash.h). It finds the last key_size tokens earlier in the sequence and proposes the tokens
// that followed them there.
// llama-server's DFlash slots and the Python bindings' Engine each keep one per sequence; it lives
// outside libikdflash because the search is part of the base's common library.

#pragma once

#include "dflash.h"

#include <memory>

class ngram_lookup {
public:
    // key_size: tokens matched (the default: docs/design.md, "N-gram lookup"); max_run: the most
    // tokens one match proposes.
    ngram_lookup(int key_size, int max_run);
    ~ngram_lookup();
    ngram_lookup(const ngram_lookup &) = delete;
    ngram_lookup & operator=(const ngram_lookup &) = delete;

    // Up to n_max tokens after tokens[0..n_tokens) and the current token. A sequence that does not
    // extend the last one (a new request) starts the maps anew.
    int propose(const llama_token * tokens, int n_tokens, llama_token current, int n_max, llama_token * out);

    // The plug for dflash_engine_set_lookup and dflash_spec_set_lookup; valid while this object lives.
    const dflash_lookup * plug() const { return &plug_; }

    static constexpr int default_key_size = 3;

private:
    struct state;
    std::unique_ptr<state> state_;
    dflash_lookup plug_{};
};
