// What the DFlash runtime's files (and the bindings' measurements) share: error handling (internal
// code throws dflash_error; the C entry points catch it and keep the message for
// dflash_last_error()), the clock, and the batch of a target pass.

#pragma once

#include "llama.h"

#include <chrono>
#include <cstdio>
#include <exception>
#include <stdexcept>
#include <string>

namespace dflash_impl {

inline thread_local std::string last_error;
inline thread_local bool last_error_is_argument = false;

struct dflash_error : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// A failure the caller's arguments caused (dflash_last_error_is_argument), not the run.
struct dflash_argument_error : dflash_error {
    using dflash_error::dflash_error;
};

template <typename Error, typename... Args>
[[noreturn]] void throw_formatted(const char * fmt, Args... args) {
    char buf[1024];
    snprintf(buf, sizeof(buf), fmt, args...);
    throw Error(buf);
}

template <typename... Args>
[[noreturn]] void fail(const char * fmt, Args... args) {
    throw_formatted<dflash_error>(fmt, args...);
}

template <typename... Args>
[[noreturn]] void fail_argument(const char * fmt, Args... args) {
    throw_formatted<dflash_argument_error>(fmt, args...);
}

// Run body for a C entry point: on an exception, keep its message (and whether the arguments
// caused it) and return on_error.
template <typename F, typename R>
R guarded(F && body, R on_error) {
    try {
        last_error.clear();
        last_error_is_argument = false;
        return body();
    } catch (const dflash_argument_error & e) {
        last_error = e.what();
        last_error_is_argument = true;
        return on_error;
    } catch (const std::exception & e) {
        last_error = e.what();
        return on_error;
    }
}

inline double now_ms() {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// batch = n tokens of sequence 0 at positions pos0.., with logits for every row or the last only.
inline void fill_seq0_batch(llama_batch & batch, const llama_token * tokens, int n, llama_pos pos0, bool all_logits) {
    batch.n_tokens = n;
    for (int j = 0; j < n; ++j) {
        batch.token[j] = tokens[j];
        batch.pos[j] = pos0 + j;
        batch.n_seq_id[j] = 1;
        batch.seq_id[j][0] = 0;
        batch.logits[j] = all_logits || j == n - 1;
    }
}

// Refuse a GGUF whose header ggml's parser would abort on or that claims more than the file holds
// (dflash-gguf-check.cpp): throws dflash_error saying what is wrong and where.
void check_gguf_layout(const char * path);

}  // namespace dflash_impl
