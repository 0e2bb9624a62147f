// bundle.h: the KDTR bundle loader (format: engine_src/README.md, "KDTR bundle format").
#pragma once

#include "json.h"

#include <cstdint>
#include <string>
#include <vector>

namespace kd {

// YaRN RoPE scaling: the config's optional `rope_scaling` object (a Hugging Face DeepSeek-V3 /
// Kimi-K2 config's, same keys and semantics; README.md, "The model"). Absent: plain RoPE.
struct RopeScaling {
    bool yarn = false;
    double factor = 1, beta_fast = 32, beta_slow = 1, mscale = 1, mscale_all_dim = 0;
    int original_max_position_embeddings = 0;
};

// The `config` object of a bundle header (field meanings: README.md, "The model").
struct ModelConfig {
    std::string name;
    int vocab_size = 0, dim = 0, n_layers = 0, n_dense_layers = 0, n_heads = 0;
    int q_lora_rank = 0, kv_lora_rank = 0, qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;
    int inter_dim = 0, moe_inter_dim = 0;
    int n_routed_experts = 0, n_shared_experts = 0, n_activated_experts = 0;
    int n_expert_groups = 1, n_limited_groups = 1;
    float route_scale = 1, rope_theta = 10000, norm_eps = 1e-6f;
    RopeScaling rope_scaling;
    int max_seq_len = 0;

    static ModelConfig from_json(const Json& j);
};

struct TensorView {
    std::string name;
    std::string dtype;            // "f32" or "i32"
    std::vector<int64_t> shape;
    const void* data = nullptr;   // into Bundle::bytes
    size_t nbytes = 0;
};

struct Bundle {
    std::string path;
    Json header;
    ModelConfig config;
    bool int4 = false;
    int drafter_block = 0;
    int mask_token = 0;
    std::vector<int32_t> prompt;
    std::vector<uint8_t> bytes;   // the whole file
    std::vector<TensorView> tensors;

    // Reads and validates a bundle; throws std::runtime_error("bundle <path>: <problem>").
    static Bundle load(const std::string& path);

    bool has(const std::string& name) const;
    // The tensor, checked against the expected dtype and shape; throws naming file and tensor.
    const TensorView& get(const std::string& name, const std::string& dtype, const std::vector<int64_t>& shape) const;
    // The golden tokens stored in the header: for tests only, never read while generating.
    std::vector<int32_t> golden() const;
};

}  // namespace kd
