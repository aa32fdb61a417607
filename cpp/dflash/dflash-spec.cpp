// One sequence's speculation step (dflash.h, "one sequence's speculation step"): the engine's
// generation and llama-server's slots both propose and accept through it.

#include "dflash.h"
#include "dflash-impl.h"

#include <algorithm>
#include <vector>

using dflash_impl::now_ms;

struct dflash_spec {
    dflash_seq * seq = nullptr;
    dflash_adapt * adapt = nullptr;
    dflash_costs * costs = nullptr;
    const dflash_lookup * lookup = nullptr;
    dflash_load * load = nullptr;
    int load_seq = 0;
    std::vector<llama_token> looked_up, drafted;
    std::vector<float> confidence;  // of each drafted token, when the controller reads them
};

namespace {

// The lookup's tokens after the current one, offered to the controller for this step's plan.
void offer_lookup(dflash_spec & spec, const llama_token * tokens, int n_tokens, llama_token current, int limit) {
    spec.looked_up.clear();
    if (spec.lookup == nullptr) {
        return;
    }
    spec.looked_up.resize(limit);
    const int n = spec.lookup->propose(spec.lookup->state, tokens, n_tokens, current, limit, spec.looked_up.data());
    spec.looked_up.resize(std::clamp(n, 0, limit));
    dflash_adapt_offer_lookup(spec.adapt, spec.looked_up.data(), (int) spec.looked_up.size());
}

}  // namespace

dflash_spec * dflash_spec_init(dflash_seq * seq, dflash_adapt * adapt, dflash_costs * costs) {
    auto * spec = new dflash_spec;
    spec->seq = seq;
    spec->adapt = adapt;
    spec->costs = costs;
    return spec;
}

void dflash_spec_free(dflash_spec * spec) { delete spec; }

void dflash_spec_set_lookup(dflash_spec * spec, const dflash_lookup * lookup) { spec->lookup = lookup; }

void dflash_spec_set_load(dflash_spec * spec, dflash_load * load, int load_seq) {
    spec->load = load;
    spec->load_seq = load_seq;
}

int dflash_spec_propose(dflash_spec * spec, const llama_token * tokens, int n_tokens, llama_token current,
                        llama_pos pos, int limit, llama_token * out, dflash_proposal * proposal) {
    *proposal = dflash_proposal{};
    if (spec->adapt == nullptr || limit <= 0) {
        return 0;
    }
    offer_lookup(*spec, tokens, n_tokens, current, limit);
    // in a shared pass, priced by what its rows add to the pass the other sequences' rows are in
    const dflash_adapt_plan plan = spec->load ? dflash_adapt_plan_step_in(spec->adapt, limit, spec->load, spec->load_seq)
                                              : dflash_adapt_plan_step(spec->adapt, limit);
    int n_verify = plan.n_verify;
    const int n = plan.n_draft;
    spec->drafted.resize(n);
    if (n > 0) {
        spec->confidence.resize(dflash_adapt_wants_confidence(spec->adapt) ? n : 0);
        float * confidence = spec->confidence.empty() ? nullptr : spec->confidence.data();
        const double t0 = now_ms();
        if (dflash_seq_draft(spec->seq, current, pos, n, spec->drafted.data(), confidence) != 0) {
            return -1;
        }
        proposal->draft_ms = now_ms() - t0;
        if (spec->costs) {
            dflash_costs_observe_draft(spec->costs, n, proposal->draft_ms);
        }
        const int n_cut = dflash_adapt_proposed(spec->adapt, spec->drafted.data(), confidence, n);
        if (!plan.lookup) {
            n_verify = n_cut;  // with the lookup's tokens verified, the draft's were a probe
        }
    }
    const std::vector<llama_token> & chosen = plan.lookup ? spec->looked_up : spec->drafted;
    std::copy(chosen.begin(), chosen.begin() + n_verify, out);
    proposal->n_verify = n_verify;
    proposal->lookup = plan.lookup;
    proposal->n_drafted = n;
    proposal->drafted = spec->drafted.data();
    if (n_verify > 0 && spec->seq != nullptr) {
        dflash_seq_save_state(spec->seq);  // the pass runs a hybrid target's recurrent state over them
    }
    return 0;
}

void dflash_spec_accept(dflash_spec * spec, int n_verified, const llama_token * committed, int n_committed) {
    if (spec->adapt != nullptr) {
        dflash_adapt_committed(spec->adapt, n_verified, committed, n_committed);
    }
}
