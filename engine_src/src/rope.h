// rope.h: a config's RoPE frequencies (plain, or YaRN-scaled as DeepSeek-V3 and Kimi-K2 do) and
// its attention softmax scale (README.md, "The model"). Host code; the backends' rope op takes
// the table.
#pragma once

#include "backend.h"
#include "bundle.h"

namespace kd {

// The frequency table of a config (throws when d_r / 2 exceeds RopeTable::kMaxPairs).
RopeTable rope_table(const ModelConfig& c);

// tau = (d_n + d_r)^-1/2, times yarn_mscale(factor, mscale_all_dim)^2 under YaRN scaling with a
// non-zero mscale_all_dim.
float softmax_scale(const ModelConfig& c);

// YaRN's magnitude term: 0.1 mscale ln(factor) + 1 (1 for factor <= 1).
double yarn_mscale(double factor, double mscale);

}  // namespace kd
