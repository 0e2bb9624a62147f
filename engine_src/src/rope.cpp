// rope.cpp: RoPE frequency tables and the softmax scale, in double precision on the host, as the
// Python reference computes them (python/kdtree_ref/model.py: rope_frequencies, softmax_scale).
#include "rope.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace kd {
namespace {
constexpr double kPi = 3.14159265358979323846;
}  // namespace

double yarn_mscale(double factor, double mscale) {
    return factor <= 1 ? 1.0 : 0.1 * mscale * std::log(factor) + 1.0;
}

RopeTable rope_table(const ModelConfig& c) {
    const int d = c.qk_rope_head_dim, pairs = d / 2;
    if (pairs > RopeTable::kMaxPairs)
        throw std::runtime_error("config: qk_rope_head_dim " + std::to_string(d) + " exceeds the engine's " +
                                 std::to_string(2 * RopeTable::kMaxPairs) + " RoPE dims");
    RopeTable t;
    const double theta = c.rope_theta;
    for (int i = 0; i < pairs; ++i) t.inv_freq[i] = std::pow(theta, -(2.0 * i) / d);
    const RopeScaling& s = c.rope_scaling;
    if (!s.yarn) return t;
    // The pair that turns `rotations` times over the original context (floored / ceiled to the
    // ramp's ends): pairs up to `low` keep their frequency, pairs from `high` on are divided by
    // the factor, linear in between.
    const auto pair_of = [&](double rotations) {
        return d * std::log(s.original_max_position_embeddings / (rotations * 2 * kPi)) / (2 * std::log(theta));
    };
    const double low = std::max(std::floor(pair_of(s.beta_fast)), 0.0);
    double high = std::min(std::ceil(pair_of(s.beta_slow)), static_cast<double>(d - 1));
    // Equal ends (Kimi-K2: beta_fast == beta_slow, or both clamped): a step at `low`, as DeepSeek-V3's
    // and Kimi-K2's reference code makes it (linear_ramp_factor: max += 0.001).
    if (high == low) high += 0.001;
    for (int i = 0; i < pairs; ++i) {
        const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
        t.inv_freq[i] = t.inv_freq[i] / s.factor * ramp + t.inv_freq[i] * (1.0 - ramp);
    }
    t.magnitude = yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim);
    return t;
}

float softmax_scale(const ModelConfig& c) {
    double tau = 1.0 / std::sqrt(static_cast<double>(c.qk_nope_head_dim + c.qk_rope_head_dim));
    const RopeScaling& s = c.rope_scaling;
    if (s.yarn && s.mscale_all_dim != 0) {
        const double m = yarn_mscale(s.factor, s.mscale_all_dim);
        tau *= m * m;
    }
    return static_cast<float>(tau);
}

}  // namespace kd
