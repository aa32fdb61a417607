// What the bindings check of a model file before the fork loads it: that it is a GGUF (the fork
// would only say "failed to load"), and whether run-time repacking keeps its results exact.

#pragma once

#include "llama.h"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>

namespace py = pybind11;

namespace ikdflash {

// Checks the fork would only report as a generic "failed to load", made specific up front.
enum class model_file { gguf, missing, not_gguf };

inline model_file model_file_kind(const std::string & path) {
    std::ifstream file(path, std::ios::binary);
    if (!file) {
        return model_file::missing;
    }
    char magic[4] = {0, 0, 0, 0};
    file.read(magic, 4);
    return file.gcount() == 4 && std::memcmp(magic, "GGUF", 4) == 0 ? model_file::gguf : model_file::not_gguf;
}

inline void check_model_file(const std::string & path) {
    switch (model_file_kind(path)) {
        case model_file::gguf:
            return;
        case model_file::missing:
            PyErr_SetString(PyExc_FileNotFoundError, ("model file not found: " + path).c_str());
            throw py::error_already_set();
        case model_file::not_gguf:
            throw py::value_error(path + ": not a GGUF file (the file does not start with 'GGUF')");
    }
}

// Whether run-time repacking changes some weights, and only weights of a type whose repacked kernel
// computes, on every row count, what a one-token decode computes (Q4_1, Q8_0; the engine's tests
// check each), so that repacking keeps speculative decoding lossless. The embedding table is never
// repacked; a target with a head of its own (output.weight) is left as stored. False for a file
// the reader cannot open.
inline bool repack_keeps_results(const std::string & path) {
    if (model_file_kind(path) != model_file::gguf) {
        return false;  // loading it says why
    }
    ggml_context * meta = nullptr;
    gguf_context * file = gguf_init_from_file(path.c_str(), gguf_init_params{/*no_alloc=*/true, &meta});
    if (file == nullptr) {
        return false;
    }
    bool exact = true, any = false;
    for (ggml_tensor * t = ggml_get_first_tensor(meta); t != nullptr; t = ggml_get_next_tensor(meta, t)) {
        if (std::strcmp(t->name, "output.weight") == 0) {
            exact = false;  // a head of its own would be repacked, and a draft's cut of it needs its rows apart
        } else if (ggml_n_dims(t) >= 2 && std::strcmp(t->name, "token_embd.weight") != 0) {
            const bool repacked = t->type == GGML_TYPE_Q4_1 || t->type == GGML_TYPE_Q8_0;
            any = any || repacked;
            exact = exact && (repacked || t->type == GGML_TYPE_F32);
        }
    }
    gguf_free(file);
    ggml_free(meta);
    return exact && any;
}

inline int default_threads() {
    return std::max(1, std::min(8, (int) std::thread::hardware_concurrency()));
}

}  // namespace ikdflash
