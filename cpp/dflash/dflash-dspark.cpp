// DSpark's heads in the draft step's graph (docs/dflash.md, "DSpark"): the Markov chain that biases
// each proposing row's logits by the token chosen before it, and the confidence head. Standard ggml
// operations only, so a GPU build runs them where the rest of the step runs.

#include "dflash-draft-state.h"

#include "ggml.h"

#include <vector>

dflash_impl::dspark_outputs dflash_impl::dspark_heads(const dflash_draft & d, ggml_context * ctx, ggml_tensor * hidden,
                                                      ggml_tensor * logits, ggml_tensor * anchor, int head_row0) {
    const int n_head = (int) hidden->ne[1];
    dspark_outputs out{{}, nullptr, nullptr};
    ggml_tensor * previous_rows = nullptr;  // [rank, n_head]: each row's W1 row, for the confidence head
    if (d.markov_rank > 0) {
        // Left to right: a row's previous token is the anchor up to the first proposing row, then
        // the row before's choice, an index into the scored ids (W1's scored rows take it).
        ggml_tensor * previous = anchor;
        bool previous_is_scored = false;
        for (int r = 0; r < n_head; ++r) {
            ggml_tensor * w1_row = ggml_get_rows(ctx, previous_is_scored ? d.markov_prev_scored : d.markov_prev, previous);
            ggml_tensor * base = ggml_view_2d(ctx, logits, logits->ne[0], 1, logits->nb[1], (size_t) r * logits->nb[1]);
            ggml_tensor * biased = ggml_add(ctx, base, ggml_mul_mat(ctx, d.markov_bias, w1_row));
            ggml_tensor * best = ggml_argmax(ctx, biased);
            out.rows.push_back(biased);
            out.ids = out.ids ? ggml_concat(ctx, out.ids, best, 0) : best;
            previous_rows = previous_rows ? ggml_concat(ctx, previous_rows, w1_row, 1) : w1_row;
            if (head_row0 + r >= d.first_proposing_row()) {
                previous = best;
                previous_is_scored = true;
            }
        }
    } else {
        out.rows.push_back(logits);
        out.ids = ggml_argmax(ctx, logits);
    }
    if (d.confidence_w != nullptr) {
        const bool with_markov = d.confidence_w->ne[0] > d.n_embd;
        ggml_tensor * features = with_markov ? ggml_concat(ctx, hidden, previous_rows, 0) : hidden;
        out.confidence = ggml_sigmoid(ctx, ggml_add(ctx, ggml_mul_mat(ctx, d.confidence_w, features), d.confidence_b));
    }
    return out;
}
