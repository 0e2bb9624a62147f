// tensor_set.cpp: the tensors a bundle's header calls for (tensor_set.h).
#include "tensor_set.h"

namespace kd {

void for_each_tensor(const Bundle& b,
                     const std::function<bool(const std::string& name, const char* dtype, const std::vector<int64_t>& shape)>& f) {
    const ModelConfig& c = b.config;
    const int64_t h = c.dim, V = c.vocab_size, H = c.n_heads, qk = int64_t{c.qk_nope_head_dim} + c.qk_rope_head_dim;
    bool go = true;
    const auto f32 = [&](const std::string& name, std::vector<int64_t> shape) {
        if (go) go = f(name, "f32", shape);
    };
    const auto linear = [&](const std::string& name, int64_t out, int64_t in, bool int4) {
        if (!int4) return f32(name, {out, in});
        if (go) go = f(name + ".qw", "i32", {out, in / 8});
        f32(name + ".sc", {out, in / 32});
    };
    const auto mlp = [&](const std::string& p, int64_t inter, bool int4) {
        linear(p + "w1", inter, h, int4);
        linear(p + "w2", h, inter, int4);
        linear(p + "w3", inter, h, int4);
    };
    f32("embed", {V, h});
    for (int i = 0; go && i < c.n_layers; ++i) {
        const std::string p = "layers." + std::to_string(i) + ".";
        f32(p + "attn_norm", {h});
        f32(p + "ffn_norm", {h});
        if (c.q_lora_rank > 0) {
            f32(p + "attn.wq_a", {c.q_lora_rank, h});
            f32(p + "attn.q_norm", {c.q_lora_rank});
            f32(p + "attn.wq_b", {H * qk, c.q_lora_rank});
        } else {
            f32(p + "attn.wq", {H * qk, h});
        }
        f32(p + "attn.wkv_a", {int64_t{c.kv_lora_rank} + c.qk_rope_head_dim, h});
        f32(p + "attn.kv_norm", {c.kv_lora_rank});
        f32(p + "attn.wkv_b", {H * (int64_t{c.qk_nope_head_dim} + c.v_head_dim), c.kv_lora_rank});
        f32(p + "attn.wo", {h, H * c.v_head_dim});
        if (i < c.n_dense_layers) {
            mlp(p + "ffn.", c.inter_dim, b.int4 && !b.keep_fp32_dense);
            continue;
        }
        f32(p + "ffn.gate.weight", {c.n_routed_experts, h});
        f32(p + "ffn.gate.bias", {c.n_routed_experts});
        for (int e = 0; go && e < c.n_routed_experts; ++e) mlp(p + "ffn.experts." + std::to_string(e) + ".", c.moe_inter_dim, b.int4);
        if (c.n_shared_experts > 0) mlp(p + "ffn.shared.", int64_t{c.n_shared_experts} * c.moe_inter_dim, b.int4 && !b.keep_fp32_shared);
    }
    f32("norm", {h});
    f32("head", {V, h});
    const int64_t L = b.drafter_block, r = b.drafter_rank;
    if (b.drafter_kind == "lowrank_head") {
        f32("drafter.v", {r, 2 * h});
        f32("drafter.u", {L, h, r});
    } else {
        f32("drafter.w", {L, V, 2 * h});
    }
    f32("drafter.b", {L, V});
}

}  // namespace kd
