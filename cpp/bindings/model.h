// The target model as the bindings hold it, shared by the binding files of _core.

#pragma once

#include "llama.h"
#include "log_capture.h"
#include "model_files.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace ikdflash {

class Model {
public:
    // repack: the fork's run-time repacking of weights into its interleaved layouts, where a type
    // has one (llama-server's -rtr; it loads the weights into memory of their own). mmap: map the
    // file's pages instead of reading the weights into memory of their own (--no-mmap: false).
    // batch_invariant: results that do not depend on the batch's row count (llama-server's
    // --batch-invariant).
    Model(const std::string & path, int n_ctx, int n_threads, int n_gpu_layers, int n_batch, bool repack = false,
          bool mmap = true, bool batch_invariant = false)
        : path_(path), batch_invariant_(batch_invariant) {
        check_model_file(path);
        if (n_ctx < 1) {
            throw py::value_error("n_ctx must be at least 1, got " + std::to_string(n_ctx));
        }
        llama_model_params mparams = llama_model_default_params();
        mparams.n_gpu_layers = n_gpu_layers;
        mparams.repack_tensors = repack;
        mparams.use_mmap = mmap;
        take_log_errors();
        {
            py::gil_scoped_release release;
            model_ = llama_model_load_from_file(path.c_str(), mparams);
        }
        if (model_ == nullptr) {
            throw py::value_error(path + ": failed to load model: " + describe_failure());
        }
        llama_context_params cparams = llama_context_default_params();
        cparams.n_ctx = n_ctx;
        cparams.n_batch = std::min(n_batch, n_ctx);
        cparams.n_ubatch = cparams.n_batch;
        cparams.n_threads = cparams.n_threads_batch = n_threads > 0 ? n_threads : default_threads();
        cparams.batch_invariant = batch_invariant;
        {
            py::gil_scoped_release release;
            ctx_ = llama_init_from_model(model_, cparams);
        }
        if (ctx_ == nullptr) {
            llama_free_model(model_);
            model_ = nullptr;
            throw py::value_error(path + ": failed to create a context: " + describe_failure());
        }
    }

    ~Model() {
        auto lock = lock_busy();
        free_native();
    }

    void close() {
        refuse_reentry("close the model");
        if (users_ > 0) {
            throw std::runtime_error(path_ + ": cannot close the model while " + std::to_string(users_) +
                                     " Draft/Engine object(s) use it: close those first");
        }
        auto lock = lock_busy();
        free_native();
    }

    // Drafts and engines borrow the model's tensors and context: each counts itself here for its
    // lifetime, and close() refuses while any is open.
    void acquire() { ++users_; }
    void release() { --users_; }

    // Native work on the context, or on a draft built on this model, runs here: with the GIL
    // released and the model's lock held, so calls from several Python threads take turns
    // instead of sharing a context that is not thread-safe.
    template <class Work>
    auto exclusive(Work && work) -> decltype(work()) {
        refuse_reentry("use the model");
        py::gil_scoped_release release;
        std::lock_guard<std::mutex> lock(busy_);
        struct owned {
            std::atomic<std::thread::id> & owner;
            explicit owned(std::atomic<std::thread::id> & o) : owner(o) { owner = std::this_thread::get_id(); }
            ~owned() { owner = std::thread::id(); }
        } mark(owner_);
        ensure_open();
        return work();
    }

    // The lock, taken with the GIL held: released only while another thread's work finishes.
    // Not taken again by the thread that holds it (a callback run by that work, freeing objects).
    std::unique_lock<std::mutex> lock_busy() {
        if (owner_ == std::this_thread::get_id()) {
            return {};
        }
        std::unique_lock<std::mutex> lock(busy_, std::try_to_lock);
        if (!lock.owns_lock()) {
            py::gil_scoped_release release;
            lock.lock();
        }
        return lock;
    }

    std::vector<llama_token> tokenize(const std::string & text, bool add_special, bool parse_special) const {
        ensure_open();
        const int n_max = (int) text.size() + 8;
        std::vector<llama_token> tokens(n_max);
        int n = llama_tokenize(model_, text.data(), (int) text.size(), tokens.data(), n_max, add_special, parse_special);
        if (n < 0) {
            tokens.resize(-n);
            n = llama_tokenize(model_, text.data(), (int) text.size(), tokens.data(), -n, add_special, parse_special);
        }
        tokens.resize(std::max(n, 0));
        return tokens;
    }

    py::bytes detokenize(const std::vector<llama_token> & tokens, bool render_special) const {
        ensure_open();
        check_tokens(tokens);
        std::string text(tokens.size() * 8 + 16, '\0');
        const llama_vocab * vocab = llama_model_get_vocab(model_);
        int n = llama_detokenize(vocab, tokens.data(), (int) tokens.size(), text.data(), (int) text.size(), false, render_special);
        if (n < 0) {
            text.resize(-n);
            n = llama_detokenize(vocab, tokens.data(), (int) tokens.size(), text.data(), (int) text.size(), false, render_special);
        }
        text.resize(std::max(n, 0));
        return py::bytes(text);
    }

    // Greedy decoding with the target alone: the reference every speculative path must equal.
    std::vector<llama_token> generate_greedy(const std::vector<llama_token> & prompt, int max_tokens, bool stop_at_eog) {
        ensure_open();
        if (prompt.empty()) {
            throw py::value_error("prompt is empty: give at least one token");
        }
        check_tokens(prompt);
        const int n_ctx = (int) llama_n_ctx(ctx_);
        if ((int) prompt.size() >= n_ctx) {
            throw py::value_error("prompt has " + std::to_string(prompt.size()) + " tokens but n_ctx is " +
                                  std::to_string(n_ctx));
        }
        std::vector<llama_token> out;
        const std::string error = exclusive([&] { return run_greedy(prompt, max_tokens, stop_at_eog, out); });
        if (!error.empty()) {
            throw std::runtime_error(path_ + ": " + error);
        }
        return out;
    }

    int n_vocab() const { ensure_open(); return llama_n_vocab(model_); }
    int n_embd() const { ensure_open(); return llama_model_n_embd(model_); }
    int n_layer() const { ensure_open(); return llama_n_layer(model_); }
    int n_ctx() const { ensure_open(); return (int) llama_n_ctx(ctx_); }
    const std::string & path() const { return path_; }
    // contexts made for this model beside its own (generate_many's) follow it
    bool batch_invariant() const { return batch_invariant_; }

    std::string meta(const std::string & key) const {
        ensure_open();
        // the call returns the full length: a value longer than the buffer (a chat template)
        // is read again into one that fits
        std::string value(512, '\0');
        int n = llama_model_meta_val_str(model_, key.c_str(), value.data(), value.size());
        if (n >= (int) value.size()) {
            value.resize(n + 1);
            n = llama_model_meta_val_str(model_, key.c_str(), value.data(), value.size());
        }
        if (n < 0) {
            throw py::key_error(key);
        }
        value.resize(n);
        return value;
    }

private:
    std::string run_greedy(const std::vector<llama_token> & prompt, int max_tokens, bool stop_at_eog,
                           std::vector<llama_token> & out) {
        llama_kv_cache_clear(ctx_);
        const int n_batch = (int) llama_n_batch(ctx_);
        const int n_ctx = (int) llama_n_ctx(ctx_);
        std::vector<llama_token> pending(prompt);
        int n_past = 0;
        while ((int) out.size() < max_tokens) {
            // the prompt goes in n_batch chunks; afterwards one token per step
            for (size_t i = 0; i < pending.size(); i += n_batch) {
                const int n = (int) std::min<size_t>(n_batch, pending.size() - i);
                llama_batch batch = llama_batch_get_one(pending.data() + i, n, n_past, 0);
                const int rc = llama_decode(ctx_, batch);
                if (rc != 0) {
                    return "llama_decode failed with code " + std::to_string(rc) + " at position " + std::to_string(n_past);
                }
                n_past += n;
            }
            const float * logits = llama_get_logits_ith(ctx_, -1);
            const int n_vocab = llama_n_vocab(model_);
            const llama_token next = (llama_token) (std::max_element(logits, logits + n_vocab) - logits);
            if (stop_at_eog && llama_token_is_eog(model_, next)) {
                break;
            }
            out.push_back(next);
            if (n_past + 1 >= n_ctx) {
                break;  // context full: the token is emitted but cannot be decoded
            }
            pending.assign(1, next);
        }
        return "";
    }

    void ensure_open() const {
        if (model_ == nullptr) {
            throw std::runtime_error(path_ + ": model is closed");
        }
    }

    // A callback run by this model's work (a stream's commit callback) cannot start more work
    // on it: the context is mid-generation, and the lock is not reentrant.
    void refuse_reentry(const char * what) const {
        if (owner_ == std::this_thread::get_id()) {
            throw std::runtime_error(path_ + ": cannot " + what + " from a callback of its own generation");
        }
    }

    void free_native() {
        if (ctx_ != nullptr) {
            llama_free(ctx_);
            ctx_ = nullptr;
        }
        if (model_ != nullptr) {
            llama_free_model(model_);
            model_ = nullptr;
        }
    }

public:
    void check_tokens(const std::vector<llama_token> & tokens) const {
        ensure_open();
        const int n_vocab = llama_n_vocab(model_);
        for (size_t i = 0; i < tokens.size(); ++i) {
            if (tokens[i] < 0 || tokens[i] >= n_vocab) {
                throw py::value_error("token " + std::to_string(tokens[i]) + " at index " + std::to_string(i) +
                                      " is outside the vocabulary (size " + std::to_string(n_vocab) + ")");
            }
        }
    }

private:
    static std::string describe_failure() {
        std::string reason = take_log_errors();
        return reason.empty() ? "no reason given by the loader (try verbose=True)" : reason;
    }

public:
    llama_model * raw_model() const { ensure_open(); return model_; }
    llama_context * raw_context() const { ensure_open(); return ctx_; }

private:
    std::string path_;
    bool batch_invariant_ = false;
    llama_model * model_ = nullptr;
    llama_context * ctx_ = nullptr;
    int users_ = 0;     // changed with the GIL held
    std::mutex busy_;   // held while native code works on ctx_ or a draft of this model
    std::atomic<std::thread::id> owner_{};  // the thread holding busy_ through exclusive()
};

}  // namespace ikdflash
