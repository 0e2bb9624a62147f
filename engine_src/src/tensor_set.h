// tensor_set.h: the tensors a KDTR bundle holds, from its header alone (docs/engine/bundle-format.md):
// the loader refuses a bundle whose table lacks one of them or lists any other.
#pragma once

#include "bundle.h"

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace kd {

// Calls f(name, dtype, shape) for every tensor a bundle of this config, quantization and drafter
// holds, in the writers' order: embed; per layer attn_norm, ffn_norm, attention (wq_a, q_norm,
// wq_b or wq; wkv_a, kv_norm, wkv_b, wo), FFN (w1, w2, w3, or gate.weight, gate.bias, experts
// 0.. w1 w2 w3, shared w1 w2 w3 when n_shared_experts > 0); norm, head, then the drafter's:
// linear drafter.w [L][V][2h], drafter.b [L][V]; lowrank_head drafter.v [r][2h], drafter.u
// [L][h][r], drafter.b [L][V]. In an int4 bundle every ffn.w1/w2/w3 is <name>.qw (i32
// [out][in/8]) and <name>.sc (f32 [out][in/32]), except the dense layers' with keep_fp32 "dense"
// and the shared expert's with "shared". Stops early when f returns false (a config may call for
// far more tensors than a table can list).
void for_each_tensor(const Bundle& b,
                     const std::function<bool(const std::string& name, const char* dtype, const std::vector<int64_t>& shape)>& f);

}  // namespace kd
