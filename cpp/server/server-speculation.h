// What llama-server's speculative decoding did, by request and in total, for every kind of
// speculation (DFlash, the lookup alone, the base's own): the fields of each response's
// `timings`, of `/slots`' `speculation` and of `/metrics`. server-context.cpp and server.cpp call
// these from their hooks; see docs/design.md#the-servers-speculation.

#pragma once

#include "server-task.h"

#include <cstdint>
#include <ostream>
#include <utility>
#include <vector>

struct server_slot;

// A slot's counts for its current request (the base keeps n_draft_total and n_draft_accepted).
struct speculation_counts {
    int32_t n_steps = 0;                   // verification passes that carried drafts
    int32_t n_lookup_drafted = 0;          // of n_draft_total, the n-gram lookup's tokens
    int32_t n_lookup_accepted = 0;         // of n_draft_accepted, the lookup's
    std::vector<int32_t> drafted_at;       // by draft position: passes that drafted it
    std::vector<int32_t> accepted_at;      // by draft position: passes that accepted it
    double t_draft_ms = 0.0;               // drafting
    double t_verify_ms = 0.0;              // target passes that carried this slot's drafts
    std::vector<std::pair<int32_t, int32_t>> recent;  // (drafted, accepted) of the last steps, oldest first
    bool low_acceptance_logged = false;
    bool drafting_stopped = false;         // min_accept: the request decodes without drafts from now on
};

// The server's totals over every finished request.
struct speculation_totals {
    uint64_t n_drafted = 0;
    uint64_t n_accepted = 0;
    uint64_t n_steps = 0;
    uint64_t n_lookup_drafted = 0;
    uint64_t n_lookup_accepted = 0;
    uint64_t n_plain_steps = 0;       // DFlash steps that verified no drafts (one-token decodes)
    uint64_t n_probes = 0;            // DFlash draft steps whose tokens were only compared
    uint64_t n_load_plain_steps = 0;  // DFlash one-token decodes the other slots' rows chose
    std::vector<uint64_t> accepted_at;  // by draft position (0-based)

    void add(const server_slot & slot);
    json to_json() const;
};

// A new request on the slot, whatever its speculation: its counts start anew, and so does a
// DFlash slot's controller.
void speculation_new_request(server_slot & slot);

// The most drafts the slot's next step may carry, before the base's limits: n_max, bounded by the
// DFlash block; 0 once min_accept stopped drafting.
int speculation_n_max(const server_slot & slot);

// Counts a verification pass of n_drafted tokens of which n_accepted were kept. Logs once when
// the acceptance over the last steps is low, and stops drafting for the request when it is below
// min_accept (> 0).
void speculation_note_step(server_slot & slot, int32_t n_drafted, int32_t n_accepted, float min_accept);

// The speculation fields of a response's timings (draft_n, draft_n_accepted, draft_steps, ...;
// docs/server.md); an empty object for a slot that does not speculate.
json speculation_timings(const server_slot & slot);

// timings with speculation_timings(slot) added (the /slots form).
json with_speculation_timings(const server_slot & slot, json timings);

// /slots' `speculation` of a slot that speculates: its timings fields and drafting_stopped.
json speculation_slot_stats(const server_slot & slot);

// The log line a finished DFlash request adds: its steps by the drafts they verified.
void speculation_print_timings(const server_slot & slot);

// /metrics: the counters (under llama.cpp's and vLLM's names) appended to the base's, and the
// labelled counter of accepted tokens per draft position written after them.
void speculation_metrics_counters(json & counters, const json & totals);
void speculation_metrics_per_position(std::ostream & prometheus, const json & totals);
