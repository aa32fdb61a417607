// llama-server's speculation statistics (server-speculation.h), compiled into llama-server from
// this repository.

#include "server-speculation.h"

#include "server-common.h"
#include "server-context.h"

#include <algorithm>
#include <string>

namespace {

// A pass's acceptance alone says little (a draft of 4 is 0, 25, ..., 100%); over these many steps
// it says whether drafting pays for this request.
constexpr size_t k_acceptance_window = 16;
constexpr float k_low_acceptance = 0.10f;  // logged below this (or below min_accept)

// The DFlash controller's steps by the tokens they verified ([0]: one-token decodes).
std::vector<int64_t> steps_by_verified(const server_slot & slot, const dflash_adapt_stats & st) {
    const int n_max = std::min(slot.params.speculative.n_max, std::min(slot.dflash.n_max, DFLASH_MAX_VERIFY));
    return std::vector<int64_t>(st.n_steps_at, st.n_steps_at + n_max + 1);
}

json counter(const char * name, const char * help, uint64_t value) {
    return json{{"name", name}, {"help", help}, {"value", value}};
}

}  // namespace

void speculation_new_request(server_slot & slot) {
    slot.spec_counts = {};
    if (slot.dflash.adapt) {
        dflash_adapt_reset(slot.dflash.adapt);
    }
}

int speculation_n_max(const server_slot & slot) {
    if (slot.spec_counts.drafting_stopped) {
        return 0;
    }
    const int n_max = slot.params.speculative.n_max;
    return slot.dflash ? std::min(n_max, slot.dflash.n_max) : n_max;  // one draft pass per step
}

void speculation_note_step(server_slot & slot, int32_t n_drafted, int32_t n_accepted, float min_accept) {
    speculation_counts & c = slot.spec_counts;
    if (n_drafted <= 0) {
        return;
    }
    c.n_steps += 1;
    if ((int32_t) c.drafted_at.size() < n_drafted) {
        c.drafted_at.resize(n_drafted, 0);
        c.accepted_at.resize(n_drafted, 0);
    }
    for (int32_t k = 0; k < n_drafted; ++k) {
        c.drafted_at[k] += 1;
        c.accepted_at[k] += k < n_accepted;
    }
    c.recent.emplace_back(n_drafted, n_accepted);
    if (c.recent.size() > k_acceptance_window) {
        c.recent.erase(c.recent.begin());
    }
    if (c.recent.size() < k_acceptance_window) {
        return;
    }
    int32_t drafted = 0, accepted = 0;
    for (const auto & [d, a] : c.recent) {
        drafted += d;
        accepted += a;
    }
    const float acceptance = (float) accepted / drafted;
    if (min_accept > 0.0f && acceptance < min_accept && !c.drafting_stopped) {
        c.drafting_stopped = true;
        SLT_WRN(slot, "acceptance %.1f%% over the last %zu steps is below min_accept %.1f%%: drafting stops for this request\n",
                100.0f * acceptance, k_acceptance_window, 100.0f * min_accept);
    } else if (acceptance < std::max(k_low_acceptance, min_accept) && !c.low_acceptance_logged) {
        c.low_acceptance_logged = true;
        SLT_WRN(slot, "low acceptance: %.1f%% of %d drafts over the last %zu steps; drafting may not pay for this request\n",
                100.0f * acceptance, drafted, k_acceptance_window);
    }
}

json speculation_timings(const server_slot & slot) {
    const speculation_counts & c = slot.spec_counts;
    if (slot.n_draft_total == 0 && !slot.dflash) {  // DFlash slots report them even when nothing was drafted
        return json::object();
    }
    json timings = {
        {"draft_n", slot.n_draft_total},
        {"draft_n_accepted", slot.n_draft_accepted},
        {"draft_steps", c.n_steps},
        {"draft_n_lookup", c.n_lookup_drafted},  // of draft_n, the n-gram lookup's tokens
        {"draft_n_accepted_lookup", c.n_lookup_accepted},
        {"draft_mean_accept_len", c.n_steps > 0 ? (double) (slot.n_draft_accepted + c.n_steps) / c.n_steps : 0.0},
        {"draft_drafted_at", c.drafted_at},
        {"draft_accepted_at", c.accepted_at},
        {"draft_ms", c.t_draft_ms},
        {"verify_ms", c.t_verify_ms},
    };
    if (slot.dflash.adapt != nullptr) {
        const dflash_adapt_stats st = dflash_adapt_get_stats(slot.dflash.adapt);
        timings["draft_steps_by_verified"] = steps_by_verified(slot, st);
        timings["draft_probes"] = st.n_probes;
        timings["draft_load_plain_steps"] = st.n_load_plain;
    }
    return timings;
}

json with_speculation_timings(const server_slot & slot, json timings) {
    timings.update(speculation_timings(slot));
    return timings;
}

json speculation_slot_stats(const server_slot & slot) {
    json stats = {{"drafting_stopped", slot.spec_counts.drafting_stopped}};
    stats.update(speculation_timings(slot));
    return stats;
}

void speculation_print_timings(const server_slot & slot) {
    if (slot.dflash.adapt == nullptr) {
        return;
    }
    const dflash_adapt_stats st = dflash_adapt_get_stats(slot.dflash.adapt);
    const std::vector<int64_t> steps = steps_by_verified(slot, st);
    // what the block length did: with adaptive=1, steps at 0 are where drafting did not pay
    std::string by_k;
    for (size_t k = 0; k < steps.size(); ++k) {
        by_k += string_format("%s%zu: %lld", k ? ", " : "", k, (long long) steps[k]);
    }
    SLT_INF(slot, "dflash: steps by drafts verified {%s}; %lld of %d tokens decoded one at a time, %lld probes\n",
            by_k.c_str(), (long long) steps[0], slot.n_decoded, (long long) st.n_probes);
}

void speculation_totals::add(const server_slot & slot) {
    const speculation_counts & c = slot.spec_counts;
    n_drafted += slot.n_draft_total;
    n_accepted += slot.n_draft_accepted;
    n_steps += c.n_steps;
    n_lookup_drafted += c.n_lookup_drafted;
    n_lookup_accepted += c.n_lookup_accepted;
    if (accepted_at.size() < c.accepted_at.size()) {
        accepted_at.resize(c.accepted_at.size(), 0);
    }
    for (size_t k = 0; k < c.accepted_at.size(); ++k) {
        accepted_at[k] += c.accepted_at[k];
    }
    if (slot.dflash.adapt) {
        const dflash_adapt_stats st = dflash_adapt_get_stats(slot.dflash.adapt);
        n_plain_steps += st.n_steps_at[0];
        n_probes += st.n_probes;
        n_load_plain_steps += st.n_load_plain;
    }
}

json speculation_totals::to_json() const {
    return json{
        {"n_drafted", n_drafted},
        {"n_accepted", n_accepted},
        {"n_steps", n_steps},
        {"n_lookup_drafted", n_lookup_drafted},
        {"n_lookup_accepted", n_lookup_accepted},
        {"n_plain_steps", n_plain_steps},
        {"n_probes", n_probes},
        {"n_load_plain_steps", n_load_plain_steps},
        {"accepted_at", accepted_at},
    };
}

void speculation_metrics_counters(json & counters, const json & totals) {
    const uint64_t drafted = totals.at("n_drafted"), accepted = totals.at("n_accepted"), steps = totals.at("n_steps");
    const uint64_t lookup_drafted = totals.at("n_lookup_drafted"), lookup_accepted = totals.at("n_lookup_accepted");
    counters.push_back(counter("draft_tokens_total", "Draft tokens offered for verification (speculative decoding).", drafted));
    counters.push_back(counter("draft_tokens_accepted_total", "Draft tokens accepted by the target (speculative decoding).", accepted));
    counters.push_back(counter("draft_steps_total", "Verification passes that carried draft tokens (speculative decoding).", steps));
    counters.push_back(counter("draft_lookup_tokens_total", "Of draft_tokens_total, the tokens DFlash's n-gram lookup proposed.", lookup_drafted));
    counters.push_back(counter("draft_lookup_tokens_accepted_total", "Of draft_tokens_accepted_total, the n-gram lookup's.", lookup_accepted));
    // the same under the names vLLM and llama.cpp export them by
    counters.push_back(counter("spec_decode_num_draft_tokens", "Draft tokens offered for verification (as draft_tokens_total).", drafted));
    counters.push_back(counter("spec_decode_num_accepted_tokens", "Draft tokens accepted by the target (as draft_tokens_accepted_total).", accepted));
    counters.push_back(counter("spec_decode_num_drafts", "Drafts verified: passes that carried draft tokens (as draft_steps_total).", steps));
    counters.push_back(counter("spec_decode_num_lookup_tokens", "Of the draft tokens, the n-gram lookup's (as draft_lookup_tokens_total).", lookup_drafted));
    counters.push_back(counter("spec_decode_num_accepted_lookup_tokens", "Of the accepted tokens, the n-gram lookup's (as draft_lookup_tokens_accepted_total).", lookup_accepted));
    counters.push_back(counter("dflash_plain_steps_total", "DFlash steps that verified no drafts: one-token decodes (the adaptive block length's k = 0).",
                               totals.at("n_plain_steps")));
    counters.push_back(counter("dflash_load_plain_steps_total", "DFlash one-token decodes chosen because of the other slots' rows in the same passes (alone they would have drafted).",
                               totals.at("n_load_plain_steps")));
    counters.push_back(counter("dflash_probes_total", "DFlash draft steps whose tokens were compared with the target's, not verified (adaptive).",
                               totals.at("n_probes")));
}

void speculation_metrics_per_position(std::ostream & prometheus, const json & totals) {
    // one labelled counter per draft position, from the first speculative request on
    const std::vector<uint64_t> accepted_at = totals.at("accepted_at");
    if (accepted_at.empty()) {
        return;
    }
    const char * name = "llamacpp:spec_decode_num_accepted_tokens_per_pos";
    prometheus << "# HELP " << name << " Draft tokens accepted at each draft position (0: the first).\n"
               << "# TYPE " << name << " counter\n";
    for (size_t k = 0; k < accepted_at.size(); ++k) {
        prometheus << name << "{position=\"" << k << "\"} " << accepted_at[k] << "\n";
    }
}
