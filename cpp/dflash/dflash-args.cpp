// The `--spec-type dflash:k=v,...` grammar for the fork's command line.

#include "dflash.h"
#include "dflash-impl.h"

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <string>

using dflash_impl::fail;
using dflash_impl::guarded;

namespace {

float parse_fraction(const std::string & key, const std::string & value) {
    char * end = nullptr;
    const float v = strtof(value.c_str(), &end);
    if (value.empty() || *end != '\0' || !(v >= 0.0f && v <= 1.0f)) {
        fail("--spec-type dflash: %s must be a number in [0, 1], got '%s'", key.c_str(), value.c_str());
    }
    return v;
}

long parse_int(const std::string & key, const std::string & value, long min) {
    char * end = nullptr;
    errno = 0;
    const long v = strtol(value.c_str(), &end, 10);
    if (value.empty() || *end != '\0') {
        fail("--spec-type dflash: %s=%s is not an integer", key.c_str(), value.c_str());
    }
    if (errno == ERANGE || v > INT32_MAX) {
        fail("--spec-type dflash: %s must be at most %d, got %s", key.c_str(), INT32_MAX, value.c_str());
    }
    if (v < min) {
        fail("--spec-type dflash: %s must be at least %ld, got %ld", key.c_str(), min, v);
    }
    return v;
}

bool parse_flag(const std::string & key, const std::string & value) {
    if (value != "0" && value != "1") {
        fail("--spec-type dflash: %s must be 0 or 1, got '%s'", key.c_str(), value.c_str());
    }
    return value == "1";
}

// The 0/1 keys, each setting one field.
struct switch_key {
    const char * name;
    bool dflash_spec_options::*field;
    uint32_t bit;
};
const switch_key k_switches[] = {
    {"full_attention", &dflash_spec_options::full_attention, DFLASH_SPEC_FULL_ATTENTION},
    {"log_drafts", &dflash_spec_options::log_drafts, DFLASH_SPEC_LOG_DRAFTS},
    {"adaptive", &dflash_spec_options::adaptive, DFLASH_SPEC_ADAPTIVE},
    {"lookup", &dflash_spec_options::lookup, DFLASH_SPEC_LOOKUP},
    {"confidence", &dflash_spec_options::confidence, DFLASH_SPEC_CONFIDENCE},
};

}  // namespace

int dflash_parse_spec_options(const char * text, dflash_spec_options * options) {
    return dflash_parse_spec_options_named(text, options, nullptr);
}

int dflash_parse_spec_options_named(const char * text, dflash_spec_options * options, uint32_t * named) {
    return guarded([&]() -> int {
        uint32_t seen = 0;
        const std::string all = text ? text : "";
        size_t begin = 0;
        while (begin < all.size()) {
            size_t end = all.find(',', begin);
            if (end == std::string::npos) {
                end = all.size();
            }
            const std::string item = all.substr(begin, end - begin);
            begin = end + 1;
            if (item.empty()) {
                continue;
            }
            const size_t eq = item.find('=');
            if (eq == std::string::npos) {
                fail("--spec-type dflash: '%s' is not key=value", item.c_str());
            }
            const std::string key = item.substr(0, eq), value = item.substr(eq + 1);
            const auto named_switch = std::find_if(std::begin(k_switches), std::end(k_switches),
                                                   [&](const switch_key & k) { return key == k.name; });
            if (named_switch != std::end(k_switches)) {
                options->*(named_switch->field) = parse_flag(key, value);
                seen |= named_switch->bit;
            } else if (key == "n_max") {
                options->n_max = (int32_t) parse_int(key, value, 1);
                seen |= DFLASH_SPEC_N_MAX;
            } else if (key == "n_min") {
                options->n_min = (int32_t) parse_int(key, value, 0);
                seen |= DFLASH_SPEC_N_MIN;
            } else if (key == "p_min") {
                options->p_min = parse_fraction(key, value);
                seen |= DFLASH_SPEC_P_MIN;
            } else if (key == "min_accept") {
                options->min_accept = parse_fraction(key, value);
                seen |= DFLASH_SPEC_MIN_ACCEPT;
            } else if (key == "conf_min") {
                options->conf_min = parse_fraction(key, value);
                seen |= DFLASH_SPEC_CONF_MIN;
            } else if (key == "cross_ctx" || key == "dflash_cross_ctx") {
                options->cross_ctx = (int32_t) parse_int(key, value, 0);  // 0: the slot's context
                seen |= DFLASH_SPEC_CROSS_CTX;
            } else {
                fail("--spec-type dflash: unknown key '%s' (known: n_max, n_min, p_min, cross_ctx, "
                     "dflash_cross_ctx, full_attention, log_drafts, min_accept, adaptive, lookup, confidence, conf_min)",
                     key.c_str());
            }
        }
        if (named != nullptr) {
            *named = seen;
        }
        return 0;
    }, -1);
}

dflash_spec_options dflash_spec_default_options(void) {
    dflash_spec_options options{};
    options.n_max = 16;
    options.p_min = 0.75f;
    options.adaptive = true;
    options.lookup = true;
    return options;
}

int dflash_parse_spec_type(const char * value, dflash_spec_options * options, uint32_t * named) {
    return guarded([&]() -> int {
        const std::string text = value ? value : "";
        const size_t colon = text.find(':');
        const std::string name = text.substr(0, colon);
        const std::string keys = colon == std::string::npos ? "" : text.substr(colon + 1);
        const bool lookup_alone = name == "lookup";
        if (!lookup_alone && name != "dflash" && name != "draft-dflash" && name != "dspark" && name != "draft-dspark") {
            return 0;
        }
        dflash_spec_options parsed = *options;
        if (dflash_parse_spec_options_named(keys.c_str(), &parsed, named) != 0) {
            return -1;
        }
        if (lookup_alone && !(parsed.lookup && parsed.adaptive)) {
            fail("--spec-type lookup: the lookup alone needs lookup=1 and adaptive=1");
        }
        parsed.draftless = lookup_alone;
        *options = parsed;
        return 1;
    }, -1);
}

const char * dflash_spec_type_usage(void) {
    return "DFlash or DSpark draft given with --model-draft (draft-dflash, dspark, draft-dspark work too),\n"
           "or lookup[:k=v,...]: the n-gram lookup alone, with no draft (n_max at most 15). Keys: n_max, n_min, p_min,\n"
           "cross_ctx (alias dflash_cross_ctx; default: the context size), full_attention (0/1), log_drafts (0/1),\n"
           "min_accept (0..1: stop drafting for a request whose acceptance over its last 16 steps is below it),\n"
           "adaptive (0/1, default 1: each step verifies as many of up to n_max drafts as pay, 0 when none do;\n"
           "0: always n_max), lookup (0/1, default 1: an n-gram lookup over the prompt and reply proposes beside\n"
           "the draft where it pays), confidence (0/1, default 0; 1: each draft token's calibrated confidence sets\n"
           "how many are verified), conf_min (0..1, default 0: no draft token from the first whose confidence is\n"
           "below it is verified; also --spec-draft-conf-min P)";
}
