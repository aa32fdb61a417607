// The measured costs of a target context's passes by row count and of a draft step (dflash.h,
// "adaptive block length"): what the controller (dflash-adapt.cpp) prices each step by.

#pragma once

#include "dflash-impl.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

namespace dflash_impl {

// A pass of another row count than the pass before rebuilds the target's graph (patch `llama-reuse-the-last-graph-for-a-multi-token-batch-o` reuses
// it only for the same shape): on SmolLM2's pair +0.4 ms on a 2-row pass after a 1-row one, +0.6
// ms back, against 3.5 ms for a one-row pass. A change of k pays that once for a run of steps, so
// the controller charges a k other than the last one this share of it per step: enough that a
// draft kept about as often as it pays does not flip k at every step, not so much that a stretch
// where drafting pays is left at k = 0. A lookup's offer comes where the text repeats and seldom
// for long, so its step pays for the rebuild into its shape and the one back, whole.
inline constexpr double k_switch_share = 0.25;
inline constexpr double k_lone_step_switches = 2.0;
// Pass costs follow the machine: running averages with these weights, and one observation moves
// an estimate by at most this factor (a stall of the shared machine is not the new cost).
inline constexpr double k_scale_weight = 0.1;
inline constexpr double k_shape_weight = 0.05;
inline constexpr double k_outlier = 3.0;
inline constexpr int k_calibration_rounds = 3;
// Calibration times every row count up to this many rows (a single sequence's blocks), and past it
// (several sequences' rows in one pass) every this many, the counts between interpolated: a
// server's 4 slots of 5 rows would otherwise time 20 passes of up to 20 rows at start-up.
inline constexpr int k_calibrated_every_row = 16;
inline constexpr int k_calibration_stride = 4;
// A row count no pass has measured for this many passes is stale: its cost is still the
// calibration's (or an old one), and a k it makes look dear is never chosen, so never measured
// again (the always-right pair once sat at k = 3 for 496 steps on a 5-row cost calibrated too
// high; a server whose start-up calibration met a busy machine never drafted). The controller
// then verifies one more draft for two steps (at k = 0, its next probe does: the second step
// reuses the graph and counts), and that measurement replaces the stale estimate (within
// k_outlier of it).
inline constexpr long k_stale_passes = 256;

// The upper median of values (0 for none).
inline double median(std::vector<double> values) {
    if (values.empty()) {
        return 0.0;
    }
    std::nth_element(values.begin(), values.begin() + values.size() / 2, values.end());
    return values[values.size() / 2];
}

inline double clamped(double value, double estimate) {
    return std::clamp(value, estimate / k_outlier, estimate * k_outlier);
}

}  // namespace dflash_impl

// The cost of a target pass over r rows is modelled as scale x shape[r] with shape[1] = 1: the
// scale follows every pass (the context grows, the machine gets busy), the shape of each row count
// only the passes of that count, so a row count the controller stopped using keeps its ratio to
// one row instead of a stale absolute time.
struct dflash_costs {
    int max_rows = 0;
    std::vector<double> shape;     // [r], r = 1..max_rows; [0] unused
    std::vector<double> priced;    // [r]: shape, never below a smaller count's (reprice)
    double scale_ms = 0.0;         // t_pass(1); 0 until measured
    std::vector<double> draft_ms;  // [n]: a draft step proposing n tokens in a run of them; 0 until measured
    double catch_up_ms = 0.0;      // a draft step after plain passes (a probe); 0 until measured
    int passes_since_draft = 0;    // target passes observed since the last draft step
    int rows_since_draft = 0;      // and their rows
    double switch_ms = 0.0;        // what a pass of another shape than the one before costs more
    bool frozen = false;           // set by IKDFLASH_COSTS: observations are ignored
    int last_rows = 0;             // rows of the pass observed before
    long n_passes = 0;             // passes observed
    std::vector<long> measured_at; // [r]: n_passes when a pass of r rows last counted

    bool stale(int rows) const {
        return !frozen && n_passes > 0 && rows >= 1 && rows <= max_rows && n_passes - measured_at[rows] > dflash_impl::k_stale_passes;
    }

    // What the controller prices a pass of `rows` rows at (see reprice).
    double pass_ms(int rows) const { return scale_ms * priced[std::clamp(rows, 1, max_rows)]; }

    // What the passes of `rows` rows have measured.
    double measured_ms(int rows) const { return scale_ms * shape[std::clamp(rows, 1, max_rows)]; }

    // Each row count's estimate follows only its own passes, which meet the machine at different
    // moments (a server's 3-row passes run while a slot between requests has its HTTP thread beside
    // them), so a count can come to measure cheaper than a smaller one, and one more draft row
    // would look free. Such a count is priced at the smaller one plus the median rise of a row.
    void reprice() {
        std::vector<double> rises;  // from one row count to the next, where it rises
        for (int r = 2; r <= std::min(max_rows, dflash_impl::k_calibrated_every_row); ++r) {
            if (shape[r] > shape[r - 1]) {
                rises.push_back(shape[r] - shape[r - 1]);
            }
        }
        const double rise = dflash_impl::median(std::move(rises));
        priced.assign(shape.begin(), shape.end());
        for (int r = 2; r <= max_rows; ++r) {
            if (shape[r] < priced[r - 1]) {
                priced[r] = priced[r - 1] + rise;
            }
        }
    }

    // The next pass's cost if it has `rows` rows: with a share of a graph rebuild where the last
    // pass had another shape.
    double next_pass_ms(int rows) const {
        return pass_ms(rows) + (rows == last_rows ? 0.0 : dflash_impl::k_switch_share * switch_ms);
    }

    // The same for a step that leaves the last pass's shape for itself alone: both rebuilds.
    double lone_pass_ms(int rows) const {
        return pass_ms(rows) + (rows == last_rows ? 0.0 : dflash_impl::k_lone_step_switches * switch_ms);
    }

    // The same for a mean number of rows, between the two whole counts around it.
    double next_pass_ms(double rows) const {
        const int below = (int) std::floor(rows);
        const double above_share = rows - below;
        return (1.0 - above_share) * next_pass_ms(below) + above_share * next_pass_ms(below + 1);
    }

    // A step proposing n tokens runs the draft's head on n rows, which for a large vocabulary costs
    // more than its layers (SmolLM2's pair: 2.1 ms for 1 token, 3.2 ms for 4). A count not yet seen
    // costs what the nearest larger one seen does (never an underestimate), else the nearest smaller.
    double draft_cost(int n) const {
        n = std::clamp(n, 1, (int) draft_ms.size() - 1);
        for (int m = n; m < (int) draft_ms.size(); ++m) {
            if (draft_ms[m] > 0.0) {
                return draft_ms[m];
            }
        }
        for (int m = n - 1; m >= 1; --m) {
            if (draft_ms[m] > 0.0) {
                return draft_ms[m];
            }
        }
        return 0.0;
    }

    // Only a pass of as many rows as the one before counts for the pass costs: the target reuses
    // its graph for it (patch `llama-reuse-the-last-graph-for-a-multi-token-batch-o`), as in a run of steps verifying the same k; counting passes
    // that rebuilt the graph made a k the controller seldom chose look dearer than it is, and kept
    // it seldom chosen. What such a pass costs more goes to switch_ms instead.
    void observe_pass(int rows, double ms) {
        const bool same_shape = rows == last_rows;
        passes_since_draft += 1;
        rows_since_draft += std::max(rows, 0);
        last_rows = rows;
        ++n_passes;
        if (frozen || rows < 1 || rows > max_rows || !(ms > 0.0)) {
            return;
        }
        if (!same_shape) {
            if (scale_ms > 0.0) {
                const double extra = std::clamp(ms - measured_ms(rows), 0.0, measured_ms(rows));
                switch_ms += dflash_impl::k_scale_weight * (extra - switch_ms);
            }
            return;
        }
        if (scale_ms <= 0.0) {
            scale_ms = ms / shape[rows];
            return;
        }
        ms = dflash_impl::clamped(ms, measured_ms(rows));
        if (rows > 1 && stale(rows)) {  // the shape is an old guess: the measurement replaces it
            shape[rows] = ms / scale_ms;
        } else if (rows == 1 || stale(1)) {
            scale_ms += dflash_impl::k_scale_weight * (ms / shape[rows] - scale_ms);
        } else {
            // One-row passes set the scale while they run: a pass of more rows moving it as well
            // (after a draft step, whose weights pushed the target's out of the caches) left its
            // own shape at the start-up's ratio (1.1 for 2 rows where 1.3 was paid).
            shape[rows] += dflash_impl::k_shape_weight * (ms / scale_ms - shape[rows]);
        }
        if (rows > 1) {
            reprice();
        }
        measured_at[rows] = n_passes;
    }

    // A draft step first projects the context rows the target added since the one before. After
    // plain passes (a probe, the first drafting step after k = 0 or after a prompt) that is much of
    // its time, and not what a step in a run of drafting steps costs (the built-in pair: ~3.0 ms
    // for a probe ~30 plain steps after the last, ~1.8 ms for a one-token step at k = 1): such a
    // step's cost goes to catch_up_ms, which prices probes, and not to draft_ms, which prices k.
    void observe_draft(int n, double ms) {
        const bool catching_up = passes_since_draft > 1 || rows_since_draft > max_rows;
        passes_since_draft = 0;
        rows_since_draft = 0;
        if (frozen || n < 1 || n >= (int) draft_ms.size() || !(ms > 0.0)) {
            return;
        }
        double & est = catching_up ? catch_up_ms : draft_ms[n];
        est = est <= 0.0 ? ms : est + dflash_impl::k_scale_weight * (dflash_impl::clamped(ms, est) - est);
    }

    // Pass times for 1..max_rows rows: a larger pass is never cheaper than a smaller one.
    void set_passes(const double * ms) {
        for (int r = 1; r <= max_rows; ++r) {
            if (!(ms[r - 1] > 0.0)) {
                dflash_impl::fail("pass time for %d rows must be positive, got %g", r, ms[r - 1]);
            }
        }
        scale_ms = ms[0];
        for (int r = 1; r <= max_rows; ++r) {
            shape[r] = std::max(ms[r - 1] / ms[0], shape[r - 1]);
        }
        reprice();
    }

    // IKDFLASH_COSTS="draft_ms:pass_ms_1,pass_ms_2,..." (tests): these costs, fixed, instead of
    // timing this machine, so the controller's choices do not depend on the machine's speed. Row
    // counts past the list cost what the last one listed does.
    bool set_from_environment() {
        const char * text = std::getenv("IKDFLASH_COSTS");
        if (text == nullptr || *text == '\0') {
            return false;
        }
        // a positive number spanning the whole of `item`, else 0
        auto positive = [](const std::string & item) {
            char * end = nullptr;
            const double v = std::strtod(item.c_str(), &end);
            return !item.empty() && *end == '\0' && v > 0.0 ? v : 0.0;
        };
        const std::string all = text;
        const size_t colon = all.find(':');
        const double draft = positive(all.substr(0, colon));
        std::vector<double> ms;
        for (size_t at = colon + 1; colon != std::string::npos && at <= all.size();) {
            const size_t comma = std::min(all.find(',', at), all.size());
            ms.push_back(positive(all.substr(at, comma - at)));
            at = comma + 1;
        }
        if (draft == 0.0 || ms.empty() || std::find(ms.begin(), ms.end(), 0.0) != ms.end()) {
            dflash_impl::fail_argument("IKDFLASH_COSTS='%s' is not draft_ms:pass_ms_1,pass_ms_2,... (positive numbers)", text);
        }
        ms.resize(max_rows, ms.back());
        set_passes(ms.data());
        std::fill(draft_ms.begin() + 1, draft_ms.end(), draft);
        frozen = true;
        return true;
    }
};
