// ikdflash._core: the Python face of the fork. Binds only what ikdflash needs, in C++, so
// there is no ctypes mirror of llama.h to drift out of step with the fork's structs.

#include "model.h"

namespace ikdflash {
void bind_dflash(py::module_ & m);
void bind_measure(py::module_ & m);
void bind_training(py::module_ & m);
}

namespace {

using namespace ikdflash;

py::dict build_info() {
    py::dict info;
    info["version"] = IKDFLASH_VERSION;
    info["system"] = std::string(llama_print_system_info());
    py::list backends;
    backends.append("CPU");
#ifdef GGML_USE_CUDA
    backends.append("CUDA");
#endif
#ifdef GGML_USE_RPC
    backends.append("RPC");  // remote workers (--rpc): offload is possible without a local GPU
#endif
    info["backends"] = backends;
    info["gpu_offload"] = llama_supports_gpu_offload();
    return info;
}

}  // namespace

PYBIND11_MODULE(_core, m) {
    m.doc() = "ikdflash native core: the ik_llama.cpp fork with DFlash";
    m.attr("__version__") = IKDFLASH_VERSION;

    llama_log_set(log_callback, nullptr);
    llama_backend_init();

    m.def("set_verbose", [](bool verbose) {
        std::lock_guard<std::mutex> lock(g_log_mutex);
        g_log_verbose = verbose;
    }, py::arg("verbose"), "Print the fork's log to stderr (off by default).");
    m.def("build_info", &build_info, "Version, compiled backends and CPU features of this build.");
    m.def("repack_keeps_results", &repack_keeps_results, py::arg("path"),
          "Whether run-time repacking changes only weights whose repacked kernels keep DFlash exact.");

    py::class_<Model>(m, "Model")
        .def(py::init<const std::string &, int, int, int, int, bool, bool, bool>(), py::arg("path"), py::arg("n_ctx") = 512,
             py::arg("n_threads") = 0, py::arg("n_gpu_layers") = 0, py::arg("n_batch") = 512,
             py::arg("repack") = false, py::arg("mmap") = true, py::arg("batch_invariant") = false)
        .def("close", &Model::close)
        .def("tokenize", &Model::tokenize, py::arg("text"), py::arg("add_special") = true,
             py::arg("parse_special") = false)
        .def("detokenize", &Model::detokenize, py::arg("tokens"), py::arg("render_special") = false)
        .def("generate_greedy", &Model::generate_greedy, py::arg("prompt"), py::arg("max_tokens"),
             py::arg("stop_at_eog") = true)
        .def("meta", &Model::meta, py::arg("key"))
        .def_property_readonly("path", &Model::path)
        .def_property_readonly("n_vocab", &Model::n_vocab)
        .def_property_readonly("n_embd", &Model::n_embd)
        .def_property_readonly("n_layer", &Model::n_layer)
        .def_property_readonly("n_ctx", &Model::n_ctx);

    bind_dflash(m);
    // apart from the runtime: what benchmarks and training use, not needed to decode
    py::module_ measure = m.def_submodule("measure", "Pass timings, memory bandwidth and requantizing, for benchmarks.");
    py::module_ training = m.def_submodule("training", "The target's layer outputs and answers: a draft's training data.");
    bind_measure(measure);
    bind_training(training);
}
