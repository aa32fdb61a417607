// Fault injection for tests (dflash_fault in dflash.h): the paths that handle a failed capture or
// a full KV cache cannot be reached with real models on demand, so tests ask for the fault by name.
// Inert unless IKDFLASH_FAULTS is set; CONTRIBUTING.md ("Fault points and pause points") lists the
// points with the Python commands' pause points.

#include "dflash.h"

#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <string>

namespace {

struct fault_plan {
    std::mutex mutex;
    std::map<std::string, std::set<long>> failing_calls;  // point -> the calls (from 1) that fail
    std::map<std::string, long> calls;
};

// IKDFLASH_FAULTS="point@k,point@k,..."; read once per process.
fault_plan * read_plan() {
    const char * text = getenv("IKDFLASH_FAULTS");
    if (text == nullptr || *text == '\0') {
        return nullptr;
    }
    auto * plan = new fault_plan;  // lives as long as the process
    std::istringstream entries(text);
    std::string entry;
    while (std::getline(entries, entry, ',')) {
        const size_t at = entry.find('@');
        char * end = nullptr;
        const long k = at == std::string::npos ? 0 : strtol(entry.c_str() + at + 1, &end, 10);
        if (k < 1 || *end != '\0') {
            fprintf(stderr, "ikdflash: IKDFLASH_FAULTS: '%s' is not point@k with k >= 1; ignored\n", entry.c_str());
            continue;
        }
        plan->failing_calls[entry.substr(0, at)].insert(k);
    }
    return plan;
}

}  // namespace

bool dflash_fault(const char * point) {
    static fault_plan * const plan = read_plan();
    if (plan == nullptr) {
        return false;
    }
    std::lock_guard<std::mutex> lock(plan->mutex);
    const auto it = plan->failing_calls.find(point);
    return it != plan->failing_calls.end() && it->second.count(++plan->calls[point]) > 0;
}
