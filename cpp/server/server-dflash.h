// llama-server's DFlash speculative decoding (--spec-type dflash) and the n-gram lookup, beside
// the draft or alone (--spec-type lookup). The base's server-context.cpp holds one call of these
// at each hook (the patch series keeps only those calls and the members below); the DFlash
// runtime itself is libikdflash (dflash.h). See docs/design.md#the-servers-speculation.

#pragma once

#include "dflash.h"
#include "llama.h"
#include "ngram-lookup.h"
#include "server-speculation.h"

#include <memory>
#include <string>
#include <vector>

struct server_context;
struct server_slot;
struct server_prompt;

// The server's DFlash state: one draft, one capture of the target's layer outputs, the target's
// pass costs and the slots' parts of the coming pass (both adaptive only).
struct server_dflash {
    dflash_draft * draft = nullptr;
    dflash_capture * capture = nullptr;
    dflash_costs * costs = nullptr;
    dflash_load * load = nullptr;
    int32_t cross_ctx = 0;  // the history each slot's draft keeps (resolved: the slot context unless set)
};

// A slot's DFlash state; empty (no seq) unless the server runs DFlash or the lookup alone.
struct server_dflash_slot {
    dflash_seq * seq = nullptr;        // the draft's context rows of the slot's sequence
    dflash_adapt * adapt = nullptr;    // how many tokens each step verifies
    dflash_spec * spec = nullptr;      // the step, on seq and adapt (the engine's too)
    std::unique_ptr<ngram_lookup> lookup;  // proposes beside the draft (lookup=1)
    int n_max = 0;                     // the most tokens a step verifies
    bool lookup_step = false;          // this step verifies the lookup's tokens
    bool replay_pending = false;       // hybrid targets: kept tokens still to replay
    bool checkpoint_pending = false;   // the request's final checkpoint waits for that replay
    int logged_task = -1;              // the task whose prompt reuse was logged

    explicit operator bool() const { return seq != nullptr; }
};

// Hybrid targets: the kept tokens of a step with rejected drafts, decoded again once every slot
// has sampled the batch.
struct dflash_replay {
    server_slot * slot;
    llama_pos pos0;
    llama_tokens tokens;
};

// --- the server ---------------------------------------------------------------------------------

// Loads the draft (with --spec-type dflash; nothing otherwise) and checks the settings against the
// model; false, logged, when the server cannot start.
bool dflash_server_load(server_context & server);
// The capture, the cross-context length and the pass costs, before the slots.
void dflash_server_init(server_context & server, int32_t n_ctx_slot);
// Whether the slots run DFlash (or the lookup alone) instead of the base's speculation.
bool dflash_server_active(const server_context & server);
void dflash_server_free(server_context & server);

// llama_state_seq_set_data (the prompt cache's restore); under IKDFLASH_FAULTS=prompt_restore@k
// the k-th call fails as one that finds no room does: the sequence's cells removed, 0 restored.
size_t dflash_state_seq_set_data(llama_context * ctx, const uint8_t * src, size_t size, llama_seq_id seq);

// --- a slot's life ------------------------------------------------------------------------------

bool dflash_slot_init(server_context & server, server_slot & slot);
// The slot's cells are gone (erase, a failed restore): so are the draft's rows.
void dflash_slot_forget(server_slot & slot);
// The prompt cache: the draft's rows travel with the prompt they describe.
void dflash_slot_save_prompt(const server_slot & slot, server_prompt & prompt);
void dflash_slot_load_prompt(server_slot & slot, bool restored);
// /slots save and restore: the draft's rows in <file>.dflash (returns the bytes written).
size_t dflash_slot_save_file(const server_slot & slot, const std::string & filename);
void dflash_slot_load_file(server_slot & slot, const std::string & filename);
// The target's cells at [p0, p1) removed and the later ones moved by delta (a context shift).
void dflash_slot_shift(server_slot & slot, llama_pos p0, llama_pos p1, llama_pos delta);
// The target keeps the slot's cells before pos (prompt reuse, a rewound banned string).
void dflash_slot_truncate(server_slot & slot, llama_pos pos, bool prompt_reuse);
// The request ends: true when its final checkpoint must wait for a replay (taken then).
bool dflash_slot_defer_checkpoint(server_slot & slot);

// --- a step ---------------------------------------------------------------------------------------

// The slot's rows in the coming pass, for the load-aware controller (0 before the slot adds any).
void dflash_slot_rows(server_context & server, const server_slot & slot, int n_rows);
// The slot's proposal for its next step: up to n_draft_max tokens, of which the controller
// verifies a leading part, the draft's or the lookup's (none when the draft step fails).
llama_tokens dflash_slot_draft(server_context & server, server_slot & slot, int n_draft_max);
// The capture before a target pass; returns the pass's start time.
int64_t dflash_view_begin(server_context & server);
// After a successful pass over the view at offset: its costs, the verification time of the slots
// whose drafts it carried, and each DFlash slot's context rows but its verification rows. False
// when the capture failed, after failing the slots that were processing.
bool dflash_view_decoded(server_context & server, const llama_batch & view, int32_t offset, int64_t t_start_us);
// A verification pass's outcome, for any speculation: ids are the slot's kept tokens (the
// accepted drafts and the target's own). Counts the step; for DFlash, commits the kept rows and
// queues a hybrid target's replay.
void speculation_verified(server_context & server, server_slot & slot, const std::vector<int> & view_rows,
                          const llama_tokens & ids, std::vector<dflash_replay> & replays);
void dflash_run_replays(server_context & server, std::vector<dflash_replay> & replays);
// A one-token decode after the first: the controller compares it with what was proposed.
void dflash_slot_decoded_one(server_slot & slot, llama_token id);
