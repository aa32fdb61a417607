// The pass and draft-step costs' C API (dflash.h), and their calibration on a context.

#include "dflash.h"
#include "dflash-costs.h"
#include "dflash-impl.h"
#include "dflash-measure.h"

#include <algorithm>
#include <vector>

using dflash_impl::fail;
using dflash_impl::guarded;
using dflash_impl::k_calibrated_every_row;
using dflash_impl::k_calibration_rounds;
using dflash_impl::k_calibration_stride;
using dflash_impl::now_ms;

dflash_costs * dflash_costs_init(int max_rows) {
    return guarded([&]() -> dflash_costs * {
        if (max_rows < 1) {
            fail("a pass has at least 1 row, got max_rows %d", max_rows);
        }
        auto c = new dflash_costs();
        c->max_rows = max_rows;
        c->shape.assign(max_rows + 1, 1.0);
        c->priced.assign(max_rows + 1, 1.0);
        c->draft_ms.assign(max_rows + 1, 0.0);
        c->measured_at.assign(max_rows + 1, 0);
        return c;
    }, (dflash_costs *) nullptr);
}

void dflash_costs_free(dflash_costs * costs) { delete costs; }

int dflash_costs_set_passes(dflash_costs * costs, const double * pass_ms) {
    return guarded([&]() -> int {
        costs->set_passes(pass_ms);
        return 0;
    }, -1);
}

double dflash_now_ms(void) { return dflash_impl::now_ms(); }

int dflash_costs_calibrate(dflash_costs * costs, llama_context * ctx) {
    return guarded([&]() -> int {
        if (costs->set_from_environment()) {
            return 0;
        }
        const int max_rows = costs->max_rows;
        if (max_rows > (int) llama_n_batch(ctx)) {
            fail("cannot time passes of %d rows with n_batch %d", max_rows, (int) llama_n_batch(ctx));
        }
        llama_batch batch = llama_batch_init(max_rows, 0, 1);
        const std::vector<llama_token> tokens(max_rows, 0);  // any ids: the cost does not depend on them
        // Passes at position 1, after one cached token (a graph is reused only there), each row
        // count twice in a row: the second reuses the first's graph, as a run of steps verifying
        // the same k does, and is the one timed (see observe_pass).
        auto decode = [&](int rows, llama_pos pos0, bool all_logits) {
            dflash_impl::fill_seq0_batch(batch, tokens.data(), rows, pos0, all_logits);
            const int rc = llama_decode(ctx, batch);
            llama_synchronize(ctx);  // a GPU backend may still be computing
            llama_kv_cache_seq_rm(ctx, 0, 1, -1);
            if (rc != 0) {
                llama_batch_free(batch);
                llama_kv_cache_clear(ctx);
                fail("a calibration pass of %d rows failed with code %d", rows, rc);
            }
        };
        // The first pass of a count after another count's rebuilds the graph: what it costs more
        // than the second is a rebuild (switch_ms; 0 until now), which later passes refine.
        std::vector<double> rebuilds;
        auto pass = [&](int rows) {
            double t0 = now_ms();
            decode(rows, 1, true);
            const double rebuilt = now_ms() - t0;
            t0 = now_ms();
            decode(rows, 1, true);  // as a verification pass
            const double reused = now_ms() - t0;
            rebuilds.push_back(std::max(0.0, rebuilt - reused));
            return reused;
        };
        llama_kv_cache_clear(ctx);
        decode(1, 0, false);
        pass(1);  // the first passes page weights in and plan buffers
        rebuilds.clear();
        std::vector<int> timed;
        for (int r = 1; r <= max_rows; r += r < k_calibrated_every_row ? 1 : k_calibration_stride) {
            timed.push_back(r);
        }
        if (timed.back() != max_rows) {
            timed.push_back(max_rows);
        }
        // rounds over every row count, so a slow moment of the machine spreads over all of them
        std::vector<double> best(max_rows, 0.0);
        for (int round = 0; round < k_calibration_rounds; ++round) {
            for (int r : timed) {
                const double ms = pass(r);
                best[r - 1] = round == 0 ? ms : std::min(best[r - 1], ms);
            }
        }
        llama_batch_free(batch);
        llama_kv_cache_clear(ctx);
        for (size_t i = 1; i < timed.size(); ++i) {  // the counts between two timed ones: on the line
            const int lo = timed[i - 1], hi = timed[i];
            for (int r = lo + 1; r < hi; ++r) {
                best[r - 1] = best[lo - 1] + (best[hi - 1] - best[lo - 1]) * (r - lo) / (hi - lo);
            }
        }
        costs->set_passes(best.data());
        costs->switch_ms = dflash_impl::median(std::move(rebuilds));
        return 0;
    }, -1);
}

void dflash_costs_observe_pass(dflash_costs * costs, int n_rows, double ms) { costs->observe_pass(n_rows, ms); }

void dflash_costs_observe_draft(dflash_costs * costs, int n_tokens, double ms) { costs->observe_draft(n_tokens, ms); }

double dflash_costs_pass_ms(const dflash_costs * costs, int n_rows) { return costs->pass_ms(n_rows); }

double dflash_costs_rebuild_ms(const dflash_costs * costs) { return costs->switch_ms; }

double dflash_costs_draft_ms(const dflash_costs * costs, int n_tokens) { return costs->draft_cost(n_tokens); }

int dflash_costs_max_rows(const dflash_costs * costs) { return costs->max_rows; }
