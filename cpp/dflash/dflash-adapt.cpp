// The adaptive block length (dflash.h, "adaptive block length"): how many draft tokens a step
// verifies, or whether it verifies the lookup's tokens instead, chosen from the measured
// acceptance per position of each and the measured costs of dflash-costs.h. Nothing here touches
// a model.

#include "dflash.h"
#include "dflash-costs.h"
#include "dflash-impl.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <vector>

using dflash_impl::fail;
using dflash_impl::guarded;

namespace {

// Acceptance estimates: each new observation at a draft position discounts the earlier ones by
// this factor, so an estimate follows roughly the last 1 / (1 - k_decay) observations: quick
// enough to follow prose turning into a quoted passage, slow enough to ride out single misses.
constexpr double k_decay = 0.9;
// Each position also has a slow estimate (the last ~100 observations), which at k = 0 moves only
// with probes. Noise in the quick one is what sends the controller there near break-even (on the
// built-in pair a draft step pays when token 1 is kept ~31% of the time, and the draft keeps it
// ~40% on chat), and what it sees then is only a probe every ~46 steps: the dip held it at k = 0
// for most of a request. At every plain step the quick estimate returns this share of the way to
// the slow one, so a dip is undone in ~10 steps; a useless draft's slow estimate keeps it at 0.
constexpr double k_slow_decay = 0.99;
constexpr double k_plain_return = 0.1;
// What a position's estimate is before it has been seen: a coin flip, worth one observation, and
// discounted like one down to a hundredth of one, so a draft that is always right reaches 0.9995
// (a prior that kept its weight would hold p_j under 0.96, and the product over 4 positions under
// 0.84) and one that is never right stays above 0.0005 (a free draft step still pays).
constexpr double k_prior_p = 0.5;
constexpr double k_prior_weight = 1.0;
constexpr double k_prior_floor = 0.01;
// A new request starts from its sequence's last estimates at this weight.
constexpr double k_carry_over = 0.5;
// At k = 0 a probe (a draft step whose tokens are only compared, not verified) asks whether the
// draft has turned right (prose turning into a quoted passage, a listing after a chat answer).
// The evidence for that is a CUSUM of the log-likelihood ratio of each probe's draft token 1
// under "kept this often" against the current estimate: a hit adds log(k_turned_right_p / p), a
// miss takes off log((1 - p) / (1 - k_turned_right_p)), and it never goes below 0. Probes run
// every longest / e^evidence plain steps. A hit the estimate already expects is no news: the
// built-in pair's chat draft keeps token 1 ~42% of the time, just short of paying, and halving
// the interval at each hit kept it probing at 6% of the plain steps (0.93x the target alone);
// here it sits at the longest interval like a useless draft, while a run of hits from a draft
// that was never right shrinks the interval to 1 within two probes.
constexpr double k_turned_right_p = 0.9;
constexpr double k_expected_p_cap = 0.5;  // above this a hit is hardly evidence; the cap keeps it some
// The longest interval keeps probes under this share of plain decoding's time (a probe drafts one
// token, and projects the context rows that arrived since the last draft step: ~3 ms on SmolLM2's
// pair, where a plain step is ~6.5 ms, so 46 steps).
constexpr double k_probe_budget = 0.01;
constexpr int k_max_probe_interval = 256;
// A step verifying k < n_limit drafts has the draft propose one token more every this many steps,
// so position k + 1 stays measured. Every step did: on the built-in pair a 2-token draft step costs
// ~0.35 ms more than a 1-token one, 4% of a step at k = 1, which kept the controller at k = 0 where
// a fixed n_max 1 ran faster than the target alone. While position k + 1 has fewer observations
// than this (its weight after decay), every step proposes it, so an always-right draft still
// climbs to n_max within a few steps.
constexpr int k_lookahead_interval = 4;
constexpr double k_lookahead_seen = 4.0;
// A drafted token's confidence (its probability under the draft's softmax, or a DSpark draft's
// confidence head) is calibrated per position and confidence tenth against what the target kept:
// discounted counts, each tenth following its last ~200 observations (fewer kept the chance ups
// and downs of a tenth's estimate in what it predicted, ~0.13 under what was kept in one tenth of
// the built-in pair's chat), whose prior is the confidence itself worth this many observations and
// discounted as a position's prior is (k_decay, down to k_prior_floor): a request's few hundred
// tokens leave most of the 40 tenths unseen, and there the draft is taken at its word.
constexpr int k_confidence_bins = 10;
constexpr double k_bin_decay = 0.995;
constexpr double k_bin_prior_weight = 2.0;


}  // namespace

// The sequences of one context that share its passes (a server's slots): each one's part of the
// coming pass, as its controller last planned it (or as its caller set it).
struct dflash_load {
    struct part {
        int rows = 0;           // rows it adds to the pass (0: not in it)
        double tokens = 0.0;    // tokens it commits, in expectation
        double draft_ms = 0.0;  // its draft step, which runs before the pass
    };
    std::vector<part> seqs;

    part others(int seq) const {
        part sum;
        for (int s = 0; s < (int) seqs.size(); ++s) {
            if (s != seq) {
                sum.rows += seqs[s].rows;
                sum.tokens += seqs[s].tokens;
                sum.draft_ms += seqs[s].draft_ms;
            }
        }
        return sum;
    }
};

// Per proposal position j (index j - 1): P(token j kept | the tokens before it kept), as
// discounted counts with a prior (see k_decay, k_prior_*).
struct position_estimates {
    std::vector<double> hits, seen, prior;

    explicit position_estimates(int n) : hits(n, 0.0), seen(n, 0.0), prior(n, k_prior_weight) {}

    double acceptance(int j) const {
        return (hits[j - 1] + prior[j - 1] * k_prior_p) / (seen[j - 1] + prior[j - 1]);
    }

    void observe(int j, bool kept) {
        hits[j - 1] = k_decay * hits[j - 1] + (kept ? 1.0 : 0.0);
        seen[j - 1] = k_decay * seen[j - 1] + 1.0;
        prior[j - 1] = std::max(k_prior_floor, k_decay * prior[j - 1]);
    }

    void carry_over() {
        for (size_t i = 0; i < hits.size(); ++i) {
            hits[i] *= k_carry_over;
            seen[i] *= k_carry_over;
            prior[i] = std::max(k_prior_floor, k_carry_over * prior[i]);
        }
    }
};

// Per draft position j and confidence tenth: P(token j kept | the tokens before it kept, its
// confidence in that tenth) (see k_bin_*).
struct confidence_calibration {
    std::vector<double> hits, seen, prior;  // [(j - 1) * k_confidence_bins + tenth]

    explicit confidence_calibration(int n)
        : hits((size_t) n * k_confidence_bins, 0.0), seen((size_t) n * k_confidence_bins, 0.0),
          prior((size_t) n * k_confidence_bins, k_bin_prior_weight) {}

    static size_t at(int j, float confidence) {
        const int tenth = std::clamp((int) (confidence * k_confidence_bins), 0, k_confidence_bins - 1);
        return (size_t) (j - 1) * k_confidence_bins + tenth;
    }

    double acceptance(int j, float confidence) const {
        const size_t i = at(j, confidence);
        return (hits[i] + prior[i] * std::clamp((double) confidence, 0.0, 1.0)) / (seen[i] + prior[i]);
    }

    void observe(int j, float confidence, bool kept) {
        const size_t i = at(j, confidence);
        hits[i] = k_bin_decay * hits[i] + (kept ? 1.0 : 0.0);
        seen[i] = k_bin_decay * seen[i] + 1.0;
        prior[i] = std::max(k_prior_floor, k_decay * prior[i]);
    }
};

// One sequence's controller. Every proposal stays pending until the target has committed a token
// at each of its positions or one differs. Every fourth step verifying k drafts proposes k + 1, so
// the position after k stays measured (against the target's own token, or a later one) and the
// controller sees when a longer block would pay; a probe proposes one token, which is what
// decides whether drafting at all pays.
struct dflash_adapt {
    const dflash_costs * costs = nullptr;  // null: fixed block length
    int n_max = 0;
    bool draftless = false;                // no draft: the lookup's offers or one-token decodes
    position_estimates draft;              // the draft's tokens
    confidence_calibration calibration;    // the draft's tokens by their confidence
    bool cut_by_confidence = false;        // dflash_adapt_use_confidence's settings
    float conf_min = 0.0f;
    std::vector<double> slow_hits, slow_seen;  // the draft's at k_slow_decay, kept across requests
    position_estimates lookup;             // the lookup's tokens (compared at every offer)
    std::vector<llama_token> offered;      // the lookup's offer for the coming step
    struct proposal {
        std::vector<llama_token> tokens;
        size_t next = 0;                   // the index compared with the next committed token
        bool from_lookup = false;
        std::vector<float> confidence;     // the draft's, per token (empty: none given)
        std::vector<double> predicted;     // and the calibrated acceptance each had when proposed
    };
    std::deque<proposal> pending;
    double turned_right = 0.0;             // the probes' evidence that the draft turned right (CUSUM)
    int since_probe = 0;                   // plain steps since the last probe
    int explore_left = 0;                  // steps still to verify one draft more (a stale pass cost)
    int since_lookahead = 0;               // verifying steps since the last that proposed one token more
    dflash_adapt_plan planned{};           // the last plan, and the load beside it
    bool exploring = false;                // it verifies one draft more to measure a stale pass cost
    dflash_load::part planned_beside{};
    dflash_adapt_stats stats{};

    dflash_adapt(const dflash_costs * costs, int n_max)
        : costs(costs), n_max(n_max), draft(n_max), calibration(n_max), slow_hits(n_max, 0.0), slow_seen(n_max, 0.0),
          lookup(n_max) {}

    // Beside other sequences a probe's draft step delays their tokens too, and each of them
    // probes: the budget is shared as the step's tokens are.
    int longest_interval(const dflash_load::part & others = {}) const {
        const double probe_ms = costs->catch_up_ms > 0.0 ? costs->catch_up_ms : costs->draft_cost(1);
        if (probe_ms <= 0.0 || costs->scale_ms <= 0.0) {
            return k_max_probe_interval;
        }
        const double step_ms = costs->pass_ms(others.rows + 1) + others.draft_ms;
        const double steps = std::ceil(probe_ms * (1.0 + others.tokens) / (k_probe_budget * step_ms));
        return (int) std::clamp(steps, 1.0, (double) k_max_probe_interval);
    }

    // A fresh sequence or request: its first plain step probes (fixed mode never probes).
    double fresh_evidence() const { return costs != nullptr ? std::log((double) longest_interval()) : 0.0; }

    // A new request starts with the evidence that probes it at its first plain step (reset).
    // Beside other sequences that start counts for nothing: each probe delays their tokens too,
    // and a new request's probes there came 2-3 times as often as the budget's interval, so only
    // hits past it shorten the interval.
    int probe_interval(const dflash_load::part & others) const {
        const double evidence = others.rows > 0 ? std::max(0.0, turned_right - fresh_evidence()) : turned_right;
        return std::max(1, (int) (longest_interval(others) * std::exp(-evidence)));
    }

    double acceptance(int j) const { return draft.acceptance(j); }  // j = 1..n_max

    // What a step verifying k drafts pays for its draft step, on average over the steps that
    // propose one token more (in steady state: the first steps at a k, which propose it every
    // time, are a transient the estimate ignores, or a k never tried would look dearer).
    double draft_cost_at(int k, int n_limit) const {
        if (k >= n_limit) {
            return costs->draft_cost(k);
        }
        return ((k_lookahead_interval - 1) * costs->draft_cost(k) + costs->draft_cost(k + 1)) / k_lookahead_interval;
    }

    int drafted_for(int k, int n_limit) {
        if (k < n_limit && (draft.seen[k] < k_lookahead_seen || ++since_lookahead >= k_lookahead_interval)) {
            since_lookahead = 0;
            return k + 1;
        }
        return k;
    }

    // Tokens a step verifying k drafts commits, in expectation, each position kept as often as p(j) says.
    template <typename Acceptance> double expected_tokens(int k, Acceptance p) const {
        double expected = 1.0, kept_through = 1.0;
        for (int j = 1; j <= k; ++j) {
            kept_through *= p(j);
            expected += kept_through;
        }
        return expected;
    }

    // Tokens per millisecond of a step verifying k tokens kept as p says, its proposal costing
    // draft_ms, in the pass beside the others' parts. A lone step (the lookup's, alone in its
    // pass) pays for leaving the last pass's shape and coming back to it.
    template <typename Acceptance>
    double rate(int k, Acceptance p, double draft_ms, const dflash_load::part & others, bool lone = false) const {
        const int rows = others.rows + k + 1;
        const double pass_ms = lone && others.rows == 0 ? costs->lone_pass_ms(rows) : costs->next_pass_ms(rows);
        return (others.tokens + expected_tokens(k, p)) / (others.draft_ms + draft_ms + pass_ms);
    }

    // The draft's k; a plain step (k = 0) has no draft step.
    template <typename Acceptance> double draft_rate(int k, int n_limit, Acceptance p, const dflash_load::part & others) const {
        return rate(k, p, k == 0 ? 0.0 : draft_cost_at(k, n_limit), others);
    }

    // The draft's k priced by the position estimates, each step verifying all k, with confidences
    // or without: the plan drafts where drafting pays before any confidence is known, and the cut
    // (proposed) may then verify less or more. A plan counting on the cut kept drafting where the
    // quick estimates had given up (design.md, "Confidence").
    auto estimates() const {
        return [this](int j) { return acceptance(j); };
    }

    // A draft whose every token is kept as often as p says: draft_rate of each k.
    template <typename Acceptance> auto rate_if(int n_limit, Acceptance p, const dflash_load::part & others) const {
        return [this, n_limit, p, &others](int k) { return draft_rate(k, n_limit, p, others); };
    }

    // The k in 0..n_limit with the most tokens per millisecond from the whole pass, rate_of(k)
    // pricing it: the other sequences' rows, tokens and draft steps are in it too, so a draft
    // pays only if what its rows add to the shared pass, and its draft step to everyone's step,
    // buys more tokens than that time would buy the others. Alone (others empty) it is this
    // sequence's own rate.
    template <typename Rate> int best_k(int n_limit, Rate rate_of) const {
        if (costs->scale_ms <= 0.0) {
            return n_limit;  // nothing measured yet: speculate, which measures
        }
        int best = 0;
        double best_rate = rate_of(0);
        for (int k = 1; k <= n_limit; ++k) {
            const double r = rate_of(k);
            if (r > best_rate) {
                best = k;
                best_rate = r;
            }
        }
        return best;
    }

    // The k of the lookup's offer whose step beats the draft's best (a plain step included) by
    // the most, with no draft step to pay for; 0 when none does.
    int lookup_k(int n_limit, int n_offered, const dflash_load::part & others) const {
        if (costs->scale_ms <= 0.0) {
            return 0;
        }
        const auto pl = [this](int j) { return lookup.acceptance(j); };
        int best = 0;
        const int k_draft = draftless ? 0 : best_k(n_limit, rate_if(n_limit, estimates(), others));
        double best_rate = draft_rate(k_draft, n_limit, estimates(), others);
        for (int k = 1; k <= std::min(n_limit, n_offered); ++k) {
            const double r = rate(k, pl, 0.0, others, true);
            if (r > best_rate) {
                best = k;
                best_rate = r;
            }
        }
        return best;
    }

    // What this sequence adds to the pass it plans for (dflash_load), its draft step priced as
    // the costs price it.
    dflash_load::part part_of(const dflash_adapt_plan & p) const {
        const double draft_ms = p.n_draft == 0 ? 0.0
                              : p.n_verify == 0 && costs->catch_up_ms > 0.0 ? costs->catch_up_ms
                                                                             : costs->draft_cost(p.n_draft);
        const position_estimates & source = p.lookup ? lookup : draft;
        return {p.n_verify + 1, expected_tokens(p.n_verify, [&](int j) { return source.acceptance(j); }), draft_ms};
    }

    dflash_adapt_plan plan(int n_limit, const dflash_load::part & others) {
        planned = choose(n_limit, others);
        planned_beside = others;
        return planned;
    }

    dflash_adapt_plan choose(int n_limit, const dflash_load::part & others) {
        exploring = false;
        n_limit = std::clamp(n_limit, 0, n_max);
        std::vector<llama_token> offer;
        offer.swap(offered);
        if (n_limit == 0) {
            return {0, 0, false};
        }
        if (costs == nullptr) {
            return {n_limit, n_limit, false};
        }
        if (!offer.empty()) {
            const int k = lookup_k(n_limit, (int) offer.size(), others);
            pending.push_back({std::move(offer), 0, true, {}, {}});
            if (k > 0) {
                // The draft does not run while the lookup wins, so it is probed as at k = 0: a
                // draft that turns out to pay more (runs longer than the lookup's) takes over.
                stats.n_lookup_steps += 1;
                const bool probe = !draftless && ++since_probe >= probe_interval(others);
                if (probe) {
                    since_probe = 0;
                    stats.n_probes += 1;
                }
                return {probe ? probe_length(n_limit, others) : 0, k, true};
            }
        }
        if (draftless) {
            return {0, 0, false};
        }
        const dflash_load::part alone{};
        int k = best_k(n_limit, rate_if(n_limit, estimates(), others));
        const bool held_by_load = k == 0 && others.rows > 0 && best_k(n_limit, rate_if(n_limit, estimates(), alone)) > 0;
        if (explore_left > 0) {
            --explore_left;
            k = std::min(k + 1, n_limit);
            exploring = true;
        } else if (k > 0 && k < n_limit && costs->stale(k + 2)) {
            explore_left = 1;  // this step and the next, whose pass reuses the graph and counts
            k += 1;
            exploring = true;
        }
        if (k > 0) {
            return {drafted_for(k, n_limit), k, false};
        }
        stats.n_load_plain += held_by_load;
        for (int j = 0; j < n_max; ++j) {
            if (slow_seen[j] > 0.0) {
                draft.hits[j] += k_plain_return * (draft.seen[j] * slow_hits[j] / slow_seen[j] - draft.hits[j]);
            }
        }
        if (++since_probe < probe_interval(others)) {
            return {0, 0, false};
        }
        // A probe asks whether the draft turned right, and beside other sequences its draft step
        // delays their tokens too. It has nothing to ask there when the draft already looks right
        // (held at k = 0 by the load alone, the sequence drafts again once the load eases; with
        // the cap on a hit's news, probes that hit kept a held sequence probing every few steps),
        // nor when even a draft kept k_turned_right_p of the time would not pay beside the
        // others' rows. Alone, probing is as before.
        const int k_if_right = best_k(n_limit, rate_if(n_limit, [](int) { return k_turned_right_p; }, others));
        if (held_by_load || (others.rows > 0 && k_if_right == 0)) {
            return {0, 0, false};
        }
        since_probe = 0;
        if (others.rows == 0 && costs->stale(2) && pays_with_free_rows(n_limit)) {
            // The 2-row pass's cost is stale: at k = 0 it is never measured, so a start-up
            // calibration taken on a busy machine would keep drafting off for good. This probe
            // verifies one draft instead, for two steps (the second reuses the graph and counts),
            // unless no pass cost could make the draft pay as it is kept now.
            explore_left = 1;
            exploring = true;
            return {drafted_for(1, n_limit), 1, false};
        }
        stats.n_probes += 1;
        return {probe_length(n_limit, others), 0, false};
    }

    // Whether some k would pay if verifying its rows cost nothing over a one-row pass: only its
    // draft step then. A draft kept too seldom for that (a useless one) has no use for a fresh
    // measure of what the rows cost.
    bool pays_with_free_rows(int n_limit) const {
        const double one_row_ms = costs->pass_ms(1);
        for (int k = 1; k <= n_limit; ++k) {
            const double tokens = expected_tokens(k, [this](int j) { return acceptance(j); });
            if (tokens / (draft_cost_at(k, n_limit) + one_row_ms) > 1.0 / one_row_ms) {
                return true;
            }
        }
        return false;
    }

    // Once probes have hit past a new request's evidence (which probes at its first plain step),
    // the draft looks right: a probe then proposes the block that would pay if every position were
    // kept that often, so the later positions get measured too. Where one draft does not pay but
    // several do (a tiny target's passes cost mostly their overhead), one-token probes kept k at 0
    // for good.
    int probe_length(int n_limit, const dflash_load::part & others) const {
        if (turned_right <= fresh_evidence()) {
            return 1;
        }
        return std::max(1, best_k(n_limit, rate_if(n_limit, [](int) { return k_turned_right_p; }, others)));
    }

    void observe(const proposal & p, bool kept) {
        const int j = (int) p.next + 1;
        if (p.from_lookup) {
            lookup.observe(j, kept);
            return;
        }
        if (j == 1) {
            const double p = std::min(acceptance(1), k_expected_p_cap);
            turned_right += kept ? std::log(k_turned_right_p / p) : std::log((1.0 - k_turned_right_p) / (1.0 - p));
            turned_right = std::max(0.0, turned_right);
        }
        slow_hits[j - 1] = k_slow_decay * slow_hits[j - 1] + (kept ? 1.0 : 0.0);
        slow_seen[j - 1] = k_slow_decay * slow_seen[j - 1] + 1.0;
        draft.observe(j, kept);
        if (!p.confidence.empty()) {
            calibration.observe(j, p.confidence[j - 1], kept);
            const double predicted = p.predicted[j - 1];
            const int tenth = std::clamp((int) (predicted * k_confidence_bins), 0, k_confidence_bins - 1);
            stats.calibration[tenth].n += 1;
            stats.calibration[tenth].kept += kept;
            stats.calibration[tenth].predicted += predicted;
        }
    }

    // The draft's proposal for the planned step; returns how many of its tokens the step verifies:
    // with confidences, the leading part with the most expected tokens per millisecond of the
    // pass, each token kept as often as its position and confidence have been; else, and when
    // the step measures a stale pass cost, as planned. The draft step is paid by now whatever the
    // choice, so only the pass is priced: a step that priced it in would verify rows slower than
    // plain decoding to spread its cost. A count whose pass has another shape than the last pays
    // both rebuilds, leaving that shape and coming back, as a lone lookup step does: the next step
    // plans the last steps' shape again. A step that verifies the lookup's tokens verifies none of
    // these.
    int proposed(const llama_token * tokens, const float * confidence, int n) {
        n = std::clamp(n, 0, n_max);
        // conf_min's floor: nothing from the first token below it is verified, whatever else says
        const int most = confidence == nullptr ? n : (int) (std::find_if(confidence, confidence + n,
                                                             [this](float c) { return c < conf_min; }) - confidence);
        const int as_planned = planned.lookup ? 0 : std::min({(int) planned.n_verify, n, most});
        if (costs == nullptr || n == 0) {
            return as_planned;
        }
        proposal p{std::vector<llama_token>(tokens, tokens + n), 0, false, {}, {}};
        int verified = as_planned;
        if (confidence != nullptr) {
            p.confidence.assign(confidence, confidence + n);
            for (int j = 1; j <= n; ++j) {
                p.predicted.push_back(calibration.acceptance(j, confidence[j - 1]));
            }
            if (cut_by_confidence && !planned.lookup && !exploring && costs->scale_ms > 0.0) {
                const auto q = [&p](int j) { return p.predicted[j - 1]; };
                dflash_load::part beside = planned_beside;
                beside.draft_ms = 0.0;  // every draft step before the pass has run by now
                double best_rate = 0.0;
                for (int m = 0; m <= most; ++m) {
                    const double r = rate(m, q, 0.0, beside, true);
                    if (r > best_rate) {
                        verified = m;
                        best_rate = r;
                    }
                }
                stats.n_confidence_cut += verified != as_planned;
            }
        }
        pending.push_back(std::move(p));
        return verified;
    }

    void offer_lookup(const llama_token * tokens, int n) {
        offered.assign(tokens, tokens + std::clamp(n, 0, n_max));
    }

    void committed(int n_verified, const llama_token * tokens, int n) {
        stats.n_steps_at[std::clamp(n_verified, 0, DFLASH_MAX_VERIFY)] += 1;
        for (int i = 0; i < n; ++i) {
            for (auto & p : pending) {
                const bool kept = p.tokens[p.next] == tokens[i];
                observe(p, kept);
                p.next = kept ? p.next + 1 : p.tokens.size();
            }
            pending.erase(std::remove_if(pending.begin(), pending.end(),
                                         [](const proposal & p) { return p.next == p.tokens.size(); }),
                          pending.end());
        }
    }

    void reset() {
        draft.carry_over();
        lookup.carry_over();
        // A new request may be one the draft gets right (a listing after a chat answer): probe at
        // its first plain step, and back off from there (a useless draft costs 1-2 probes more a
        // request: one miss takes off ~2 of the log(longest) ~3.2 on the built-in pair).
        turned_right = fresh_evidence();
        since_probe = 0;
        explore_left = 0;
        pending.clear();
        offered.clear();
        stats = {};
    }
};

dflash_adapt * dflash_adapt_init(const dflash_costs * costs, int n_max) {
    return guarded([&]() -> dflash_adapt * {
        if (n_max < 0 || n_max > DFLASH_MAX_VERIFY) {
            fail("n_max must be in 0..%d, got %d", DFLASH_MAX_VERIFY, n_max);
        }
        if (costs != nullptr && costs->max_rows < n_max + 1) {
            fail("the pass costs cover %d rows, a step of n_max %d needs %d", costs->max_rows, n_max, n_max + 1);
        }
        auto a = new dflash_adapt(costs, n_max);
        a->turned_right = a->fresh_evidence();
        return a;
    }, (dflash_adapt *) nullptr);
}

dflash_adapt * dflash_adapt_init_draftless(const dflash_costs * costs, int n_max) {
    if (costs == nullptr) {
        dflash_impl::last_error = "a controller without a draft needs pass costs: it only verifies what pays";
        return nullptr;
    }
    dflash_adapt * a = dflash_adapt_init(costs, n_max);
    if (a != nullptr) {
        a->draftless = true;
    }
    return a;
}

void dflash_adapt_free(dflash_adapt * adapt) { delete adapt; }

void dflash_adapt_reset(dflash_adapt * adapt) { adapt->reset(); }

dflash_adapt_plan dflash_adapt_plan_step(dflash_adapt * adapt, int n_limit) { return adapt->plan(n_limit, {}); }

dflash_load * dflash_load_init(int n_seq) {
    return guarded([&]() -> dflash_load * {
        if (n_seq < 1) {
            fail("a load has at least 1 sequence, got %d", n_seq);
        }
        auto load = new dflash_load();
        load->seqs.resize(n_seq);
        return load;
    }, (dflash_load *) nullptr);
}

void dflash_load_free(dflash_load * load) { delete load; }

void dflash_load_set(dflash_load * load, int seq, int n_rows, double n_tokens, double draft_ms) {
    if (seq >= 0 && seq < (int) load->seqs.size()) {
        load->seqs[seq] = {std::max(n_rows, 0), std::max(n_tokens, 0.0), std::max(draft_ms, 0.0)};
    }
}

dflash_adapt_plan dflash_adapt_plan_step_in(dflash_adapt * adapt, int n_limit, dflash_load * load, int seq) {
    const dflash_adapt_plan p = adapt->plan(n_limit, load->others(seq));
    if (seq >= 0 && seq < (int) load->seqs.size()) {
        load->seqs[seq] = adapt->costs != nullptr ? adapt->part_of(p) : dflash_load::part{p.n_verify + 1, 1.0, 0.0};
    }
    return p;
}

void dflash_adapt_use_confidence(dflash_adapt * adapt, bool calibrated_cut, float conf_min) {
    adapt->cut_by_confidence = calibrated_cut && adapt->costs != nullptr;
    adapt->conf_min = conf_min;
}

bool dflash_adapt_wants_confidence(const dflash_adapt * adapt) {
    return adapt->cut_by_confidence || adapt->conf_min > 0.0f;
}

int dflash_adapt_proposed(dflash_adapt * adapt, const llama_token * tokens, const float * confidence, int n) {
    return adapt->proposed(tokens, confidence, n);
}

void dflash_adapt_offer_lookup(dflash_adapt * adapt, const llama_token * tokens, int n) {
    adapt->offer_lookup(tokens, n);
}

void dflash_adapt_committed(dflash_adapt * adapt, int n_verified, const llama_token * tokens, int n) {
    adapt->committed(n_verified, tokens, n);
}

float dflash_adapt_acceptance(const dflash_adapt * adapt, int j) {
    return j >= 1 && j <= adapt->n_max ? (float) adapt->acceptance(j) : 0.0f;
}

float dflash_adapt_lookup_acceptance(const dflash_adapt * adapt, int j) {
    return j >= 1 && j <= adapt->n_max ? (float) adapt->lookup.acceptance(j) : 0.0f;
}

dflash_adapt_stats dflash_adapt_get_stats(const dflash_adapt * adapt) { return adapt->stats; }
