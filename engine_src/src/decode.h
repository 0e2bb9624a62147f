// decode.h: greedy autoregressive and DDTree decode loops over a Model.
#pragma once

#include "model.h"

#include <cstdint>
#include <vector>

namespace kd {

struct Generation {
    std::vector<int32_t> tokens;     // the n generated tokens (the prompt not included)
    std::vector<int32_t> accepted;   // DDTree: acceptance length of each round (accepted nodes + 1)
    double prefill_seconds = 0;
    double decode_seconds = 0;       // everything after the prefill
    double prefill_cpu_seconds = 0;  // the process's CPU seconds (all threads) over the same spans
    double decode_cpu_seconds = 0;
    int forwards = 0;                // target forwards after the prefill
    BackendCounters decode_counters; // what the backend queued after the prefill (backend.h)

    double accept_mean() const;
    double tokens_per_second() const;         // generated tokens / (prefill + decode time)
    double decode_tokens_per_second() const;  // tokens after the prefill's first / decode time
    double prefill_tokens_per_second(size_t prompt_tokens) const;  // 0 without a prefill time
    // The same rates per CPU second (0 when no CPU time was seen): the work the code did, whatever
    // share of the cores other processes left it.
    double tokens_per_cpu_second() const;
    double decode_tokens_per_cpu_second() const;
    double prefill_tokens_per_cpu_second(size_t prompt_tokens) const;
    double cpu_share() const;                 // CPU seconds per wall second over the whole run
};

// The process's CPU seconds so far, all threads (std::clock).
double cpu_seconds();

// Greedy AR: prefill the prompt, then one token per forward. The model's cache starts empty.
Generation generate_ar(Model& model, const std::vector<int32_t>& prompt, int n);

// Greedy DDTree with node budget `budget` and draft depth `block` (<= the bundle's drafter block).
// Output equals generate_ar's token for token.
Generation generate_ddtree(Model& model, const std::vector<int32_t>& prompt, int n, int budget, int block);

// Rows one forward needs for a prompt of this length in either mode (Model's max_batch).
int batch_rows_needed(size_t prompt_len, int budget);

}  // namespace kd
