// Measurements for benchmarks/passes/cost.py: target passes by row count at a given context
// length, split by operation on request, requantized copies of a model, and the machine's
// memory-read bandwidth, the floor that a one-row pass over weights that do not fit in cache
// stands beside.

#include "model.h"

#include "dflash-measure.h"

#include <map>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

namespace ikdflash {

namespace {


// Milliseconds per operation of the passes computed while it is installed, through the context's
// eval callback: asked about every node, the scheduler computes the graph one node at a time, so
// each node's time is its own plus a thread pool's start (the same at any row count: compare the
// row counts op by op, not the split's total with an undivided pass). A matrix product is named
// by its weight ("mul_mat attn_q", "mul_mat output"), other nodes by their operation.
class OpTimer {
public:
    explicit OpTimer(llama_context * ctx) : ctx_(ctx) {
        saved_ = llama_get_eval_callback(ctx_, &saved_data_);
        llama_set_eval_callback(ctx_, &OpTimer::on_node, this);
    }
    ~OpTimer() { llama_set_eval_callback(ctx_, saved_, saved_data_); }
    OpTimer(const OpTimer &) = delete;
    OpTimer & operator=(const OpTimer &) = delete;

    std::map<std::string, double> take() { return std::exchange(ms_, {}); }

private:
    static std::string category(const ggml_tensor * t) {
        if ((t->op == GGML_OP_MUL_MAT || t->op == GGML_OP_MUL_MAT_ID) && t->src[0] != nullptr) {
            std::string weight = t->src[0]->name;
            if (weight.rfind("blk.", 0) == 0) {
                weight.erase(0, weight.find('.', 4) + 1);  // "blk.12.attn_q.weight" -> "attn_q.weight"
            }
            if (const size_t dot = weight.rfind(".weight"); dot != std::string::npos) {
                weight.erase(dot);
            }
            return "mul_mat " + weight;
        }
        return ggml_op_desc(t);
    }

    static bool on_node(ggml_tensor * t, bool ask, void * user_data) {
        auto * self = (OpTimer *) user_data;
        if (ask) {
            self->started_ = dflash_now_ms();
            return true;  // every node: computed alone, then reported
        }
        self->ms_[category(t)] += dflash_now_ms() - self->started_;
        return true;
    }

    llama_context * ctx_;
    ggml_backend_sched_eval_callback saved_ = nullptr;
    void * saved_data_ = nullptr;
    double started_ = 0.0;
    std::map<std::string, double> ms_;
};

// For each row count in n_rows, the times of `repeats` passes of that many rows at positions
// n_context.. (every row's logits kept, as in a verification pass), each from the same n_context
// cached tokens (the rows are dropped after each pass). The counts take turns within each round,
// so a slow moment of a shared machine spreads over all of them.
// With op_ms, each pass is also split by operation (OpTimer): op_ms[k] gets one map per pass of
// n_rows[k] rows.
std::vector<std::vector<double>> time_passes(Model & model, const std::vector<int> & n_rows, int n_context,
                                             int repeats,
                                             std::vector<std::vector<std::map<std::string, double>>> * op_ms = nullptr) {
    llama_context * ctx = model.raw_context();
    const int n_batch = (int) llama_n_batch(ctx);
    int most = 0;
    for (int n : n_rows) {
        if (n < 1 || n > n_batch) {
            throw py::value_error("row counts must be in 1.." + std::to_string(n_batch) + " (the model's n_batch), got " +
                                  std::to_string(n));
        }
        most = std::max(most, n);
    }
    if (n_context < 0 || n_context + most > (int) llama_n_ctx(ctx)) {
        throw py::value_error(std::to_string(n_context) + " cached tokens and " + std::to_string(most) +
                              " rows do not fit the context of " + std::to_string(llama_n_ctx(ctx)));
    }
    if (repeats < 1) {
        throw py::value_error("repeats must be at least 1, got " + std::to_string(repeats));
    }
    std::vector<llama_token> tokens(n_context + most);  // any ids: the cost does not depend on them
    for (size_t pos = 0; pos < tokens.size(); ++pos) {
        tokens[pos] = (17 * (int) pos + 100) % model.n_vocab();
    }
    std::vector<std::vector<double>> times(n_rows.size());
    const std::string error = model.exclusive([&]() -> std::string {
        llama_batch batch = llama_batch_init(n_batch, 0, 1);
        auto decode = [&](int pos0, int n, bool all_logits) {
            dflash_batch_seq0(&batch, tokens.data() + pos0, n, pos0, all_logits);
            return llama_decode(ctx, batch);
        };
        std::string failure;
        llama_kv_cache_clear(ctx);
        for (int i = 0; i < n_context && failure.empty(); i += n_batch) {
            if (decode(i, std::min(n_batch, n_context - i), false) != 0) {
                failure = "the context's prefill failed";
            }
        }
        std::unique_ptr<OpTimer> timer;
        if (op_ms != nullptr) {
            op_ms->assign(n_rows.size(), {});
            timer = std::make_unique<OpTimer>(ctx);  // after the prefill: only the timed passes
        }
        for (int r = 0; r < repeats && failure.empty(); ++r) {
            for (size_t k = 0; k < n_rows.size() && failure.empty(); ++k) {
                const double t0 = dflash_now_ms();
                const int rc = decode(n_context, n_rows[k], true);
                llama_synchronize(ctx);
                times[k].push_back(dflash_now_ms() - t0);
                if (timer) {
                    (*op_ms)[k].push_back(timer->take());
                }
                llama_kv_cache_seq_rm(ctx, 0, n_context, -1);
                if (rc != 0) {
                    failure = "a pass of " + std::to_string(n_rows[k]) + " rows failed with code " + std::to_string(rc);
                }
            }
        }
        llama_batch_free(batch);
        llama_kv_cache_clear(ctx);
        return failure;
    });
    if (!error.empty()) {
        throw std::runtime_error(model.path() + ": " + error);
    }
    return times;
}

// For each row count, one map per pass: milliseconds by operation (see OpTimer).
std::vector<std::vector<std::map<std::string, double>>> time_pass_ops(Model & model, const std::vector<int> & n_rows,
                                                                       int n_context, int repeats) {
    std::vector<std::vector<std::map<std::string, double>>> op_ms;
    time_passes(model, n_rows, n_context, repeats, &op_ms);
    return op_ms;
}

// GB/s of n_threads threads each summing its share of a buffer of `mib` MiB (touched first, so the
// pages exist), the best of `repeats` rounds.
double memory_read_bandwidth(int n_threads, int mib, int repeats) {
    if (n_threads < 1 || mib < 1 || repeats < 1) {
        throw py::value_error("n_threads, mib and repeats must be at least 1");
    }
    py::gil_scoped_release release;
    const size_t n = (size_t) mib * 1024 * 1024 / sizeof(uint64_t);
    std::vector<uint64_t> buffer(n, 1);
    std::vector<uint64_t> sums(n_threads);
    double best = 0.0;
    for (int r = 0; r < repeats; ++r) {
        const double t0 = dflash_now_ms();
        std::vector<std::thread> threads;
        for (int t = 0; t < n_threads; ++t) {
            threads.emplace_back([&, t] {
                const size_t begin = n * t / n_threads, end = n * (t + 1) / n_threads;
                uint64_t sum = 0;
                for (size_t i = begin; i < end; ++i) {
                    sum += buffer[i];
                }
                sums[t] = sum;  // kept, so the loop is not optimised away
            });
        }
        for (auto & th : threads) {
            th.join();
        }
        const double ms = dflash_now_ms() - t0;
        best = std::max(best, (double) (n * sizeof(uint64_t)) / (ms * 1e6));
    }
    uint64_t total = 0;
    for (uint64_t s : sums) {
        total += s;
    }
    if (total != n) {
        throw std::runtime_error("the bandwidth buffer summed wrong");
    }
    return best;
}

// A copy of the GGUF at src, its weights requantized to `type` (the fork's own quantizer, as
// llama-quantize --allow-requantize runs it).
void quantize(const std::string & src, const std::string & dst, const std::string & type, int n_threads) {
    static const std::map<std::string, llama_ftype> types = {
        {"Q4_0", LLAMA_FTYPE_MOSTLY_Q4_0},     {"Q4_1", LLAMA_FTYPE_MOSTLY_Q4_1},
        {"Q8_0", LLAMA_FTYPE_MOSTLY_Q8_0},     {"Q4_K_M", LLAMA_FTYPE_MOSTLY_Q4_K_M},
        {"Q6_K", LLAMA_FTYPE_MOSTLY_Q6_K},     {"IQ4_NL", LLAMA_FTYPE_MOSTLY_IQ4_NL},
        {"IQ4_XS", LLAMA_FTYPE_MOSTLY_IQ4_XS},
    };
    check_model_file(src);
    const auto it = types.find(type);
    if (it == types.end()) {
        std::string known;
        for (const auto & [name, ftype] : types) {
            known += (known.empty() ? "" : ", ") + name;
        }
        throw py::value_error("unknown quantization type '" + type + "' (known: " + known + ")");
    }
    llama_model_quantize_params params = llama_model_quantize_default_params();
    params.ftype = it->second;
    params.nthread = n_threads;
    params.allow_requantize = true;
    params.ignore_imatrix_rules = true;  // a cost measurement: no importance matrix needed
    uint32_t rc;
    {
        py::gil_scoped_release release;
        rc = llama_model_quantize(src.c_str(), dst.c_str(), &params);
    }
    if (rc != 0) {
        throw std::runtime_error(src + ": quantizing to " + type + " failed (code " + std::to_string(rc) + ")");
    }
}

}  // namespace

void bind_measure(py::module_ & m) {
    m.def("time_passes", [](Model & model, const std::vector<int> & n_rows, int n_context, int repeats) {
              return time_passes(model, n_rows, n_context, repeats);
          }, py::arg("model"), py::arg("n_rows"), py::arg("n_context"), py::arg("repeats"),
          "For each row count, milliseconds of `repeats` target passes of that many rows after n_context cached tokens.");
    m.def("time_pass_ops", &time_pass_ops, py::arg("model"), py::arg("n_rows"), py::arg("n_context"),
          py::arg("repeats"),
          "As time_passes, each pass split by operation (computed a node at a time): per row count, one "
          "{operation: ms} per pass.");
    m.def("memory_read_bandwidth", &memory_read_bandwidth, py::arg("n_threads"), py::arg("mib") = 1024,
          py::arg("repeats") = 5, "GB/s read by n_threads threads summing a buffer of `mib` MiB (best of repeats).");
    m.def("quantize", &quantize, py::arg("src"), py::arg("dst"), py::arg("type"), py::arg("n_threads") = 0,
          "Requantize the GGUF at src to dst (Q4_0, Q4_1, Q8_0, Q4_K_M, Q6_K, IQ4_NL, IQ4_XS).");
}

}  // namespace ikdflash
