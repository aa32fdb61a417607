// The fork's log, as the bindings take it: it reports why a load failed only through its log,
// so the recent error lines are kept to go into the Python exception, and everything is printed
// only when asked (verbose).

#pragma once

#include "llama.h"

#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

namespace ikdflash {

inline std::mutex g_log_mutex;
inline bool g_log_verbose = false;
inline std::vector<std::string> g_log_errors;

inline void log_callback(ggml_log_level level, const char * text, void * /*user_data*/) {
    std::lock_guard<std::mutex> lock(g_log_mutex);
    if (level == GGML_LOG_LEVEL_ERROR && text != nullptr) {
        std::string line(text);
        while (!line.empty() && (line.back() == '\n' || line.back() == ' ')) {
            line.pop_back();
        }
        if (!line.empty()) {
            g_log_errors.push_back(line);
            if (g_log_errors.size() > 8) {
                g_log_errors.erase(g_log_errors.begin());
            }
        }
    }
    if (g_log_verbose) {
        fputs(text, stderr);
    }
}

inline std::string take_log_errors() {
    std::lock_guard<std::mutex> lock(g_log_mutex);
    std::string joined;
    for (const auto & line : g_log_errors) {
        joined += (joined.empty() ? "" : "; ") + line;
    }
    g_log_errors.clear();
    return joined;
}

}  // namespace ikdflash
