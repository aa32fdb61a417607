// Error handling shared by the DFlash runtime's files: internal code throws dflash_error; the C
// entry points catch it and keep the message for dflash_last_error().

#pragma once

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

// Refuse a GGUF whose header ggml's parser would abort on or that claims more than the file holds
// (dflash-gguf-check.cpp): throws dflash_error saying what is wrong and where.
void check_gguf_layout(const char * path);

}  // namespace dflash_impl
