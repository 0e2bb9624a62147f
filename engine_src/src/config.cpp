// config.cpp: the bundle config's field table, the relations between fields, and the memory a
// model of a config needs. A new config field is one row in kIntFields or kFloatFields (plus a
// relation below when it constrains others); nothing reads a field the table has not checked.
#include "backend.h"
#include "bundle.h"
#include "checked.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <stdexcept>

namespace kd {
namespace {

constexpr int64_t kMaxDim = int64_t{1} << 16;   // any width of one vector
constexpr int64_t kMaxWide = int64_t{1} << 20;  // FFN widths

struct IntField {
    const char* key;
    int ModelConfig::*member;
    int64_t min, max;
    bool required;
    int fallback;  // when absent and not required
};

struct FloatField {
    const char* key;
    float ModelConfig::*member;
    double min, max;  // min is exclusive: every float field is strictly positive
    float fallback;
};

const IntField kIntFields[] = {
    {"vocab_size", &ModelConfig::vocab_size, 2, int64_t{1} << 24, true, 0},
    {"dim", &ModelConfig::dim, 1, kMaxDim, true, 0},
    {"n_layers", &ModelConfig::n_layers, 1, 1024, true, 0},
    {"n_dense_layers", &ModelConfig::n_dense_layers, 0, 1024, false, 0},
    {"n_heads", &ModelConfig::n_heads, 1, 1024, true, 0},
    {"q_lora_rank", &ModelConfig::q_lora_rank, 0, kMaxDim, false, 0},
    {"kv_lora_rank", &ModelConfig::kv_lora_rank, 1, kMaxDim, true, 0},
    {"qk_nope_head_dim", &ModelConfig::qk_nope_head_dim, 1, kMaxDim, true, 0},
    // The backends rotate at most RopeTable::kMaxPairs pairs (a fixed table passed by value to kernels).
    {"qk_rope_head_dim", &ModelConfig::qk_rope_head_dim, 2, 2 * RopeTable::kMaxPairs, true, 0},
    {"v_head_dim", &ModelConfig::v_head_dim, 1, kMaxDim, true, 0},
    {"inter_dim", &ModelConfig::inter_dim, 0, kMaxWide, false, 0},
    {"moe_inter_dim", &ModelConfig::moe_inter_dim, 0, kMaxWide, false, 0},
    {"n_routed_experts", &ModelConfig::n_routed_experts, 0, kMaxDim, false, 0},
    {"n_shared_experts", &ModelConfig::n_shared_experts, 0, 64, false, 0},
    {"n_activated_experts", &ModelConfig::n_activated_experts, 0, kMaxDim, false, 0},
    {"n_expert_groups", &ModelConfig::n_expert_groups, 1, kMaxDim, false, 1},
    {"n_limited_groups", &ModelConfig::n_limited_groups, 1, kMaxDim, false, 1},
    {"max_seq_len", &ModelConfig::max_seq_len, 2, int64_t{1} << 24, true, 0},
};

const FloatField kFloatFields[] = {
    {"route_scale", &ModelConfig::route_scale, 0.0, 1e6, 1.0f},
    {"rope_theta", &ModelConfig::rope_theta, 0.0, 1e30, 10000.0f},
    {"norm_eps", &ModelConfig::norm_eps, 0.0, 1.0, 1e-6f},
};

// The optional `rope_scaling` object (YaRN): every key known, every value finite and in range.
RopeScaling rope_scaling_from_json(const Json& j) {
    const std::string where = "config.rope_scaling";
    if (!j.is_object()) throw std::runtime_error(where + ": expected an object, got " + j.type_name());
    static const char* const kKeys[] = {"type", "factor", "original_max_position_embeddings", "beta_fast",
                                        "beta_slow", "mscale", "mscale_all_dim"};
    for (const auto& kv : j.members())
        if (std::find_if(std::begin(kKeys), std::end(kKeys), [&](const char* k) { return kv.first == k; }) == std::end(kKeys))
            throw std::runtime_error(where + "." + printable(kv.first) + ": unknown field (this engine does not implement it)");
    const Json* type = j.find("type");
    if (!type || !type->is_string() || type->as_string() != "yarn")
        throw std::runtime_error(where + ".type: expected \"yarn\" (the only scaling this engine implements)");
    const auto number = [&](const char* key, double fallback, double lo, double hi) {
        const Json* v = j.find(key);
        if (!v) return fallback;
        if (!v->is_number()) throw std::runtime_error(where + "." + key + ": expected a number, got " + v->type_name());
        const double x = v->as_number();
        if (!(x >= lo && x <= hi))  // also false for NaN
            throw std::runtime_error(where + "." + key + ": " + describe(*v) + " is outside [" + Json(lo).dump() + ", " +
                                     Json(hi).dump() + "]");
        return x;
    };
    RopeScaling r;
    r.yarn = true;
    r.factor = number("factor", 1, 1, 1e6);
    const Json* original = j.find("original_max_position_embeddings");
    if (!original || !original->is_integer() || original->as_int() < 1 || original->as_int() > (int64_t{1} << 24))
        throw std::runtime_error(where + ".original_max_position_embeddings: expected an integer in [1, 16777216]");
    r.original_max_position_embeddings = static_cast<int>(original->as_int());
    r.beta_fast = number("beta_fast", 32, 1e-6, 1e6);
    r.beta_slow = number("beta_slow", 1, 1e-6, 1e6);
    // Equal betas are Kimi-K2's (both 1): rope.cpp handles the zero-width ramp as its reference code does.
    if (!(r.beta_fast >= r.beta_slow)) throw std::runtime_error(where + ": needs beta_fast >= beta_slow");
    r.mscale = number("mscale", 1, 0, 1e3);
    r.mscale_all_dim = number("mscale_all_dim", 0, 0, 1e3);
    return r;
}

// A relation between fields: `holds` is checked once every field has passed its row.
struct Relation {
    const char* fields;  // the fields it is about, for the message
    const char* rule;
    std::function<bool(const ModelConfig&)> holds;
};

const Relation kRelations[] = {
    {"n_dense_layers", "n_dense_layers <= n_layers", [](const ModelConfig& c) { return c.n_dense_layers <= c.n_layers; }},
    {"qk_rope_head_dim", "qk_rope_head_dim is even (RoPE rotates pairs)",
     [](const ModelConfig& c) { return c.qk_rope_head_dim % 2 == 0; }},
    {"inter_dim", "inter_dim >= 1 when there are dense layers",
     [](const ModelConfig& c) { return c.n_dense_layers == 0 || c.inter_dim >= 1; }},
    {"moe_inter_dim", "moe_inter_dim >= 1 when there are MoE layers",
     [](const ModelConfig& c) { return !c.has_moe() || c.moe_inter_dim >= 1; }},
    {"n_routed_experts", "n_routed_experts >= 1 when there are MoE layers",
     [](const ModelConfig& c) { return !c.has_moe() || c.n_routed_experts >= 1; }},
    {"n_activated_experts", "1 <= n_activated_experts <= n_routed_experts when there are MoE layers",
     [](const ModelConfig& c) { return !c.has_moe() || (c.n_activated_experts >= 1 && c.n_activated_experts <= c.n_routed_experts); }},
    {"n_expert_groups", "n_expert_groups divides n_routed_experts",
     [](const ModelConfig& c) { return !c.has_moe() || c.n_routed_experts % c.n_expert_groups == 0; }},
    {"n_limited_groups", "n_limited_groups <= n_expert_groups",
     [](const ModelConfig& c) { return c.n_limited_groups <= c.n_expert_groups; }},
    {"n_activated_experts", "n_activated_experts <= the experts in the kept groups (n_limited_groups x n_routed_experts / n_expert_groups)",
     [](const ModelConfig& c) {
         return !c.has_moe() ||
                int64_t{c.n_activated_experts} <= int64_t{c.n_limited_groups} * (c.n_routed_experts / c.n_expert_groups);
     }},
};

// The widths the model computes in int (model.cpp), each checked to fit.
void check_derived_sizes(const ModelConfig& c) {
    const int qk = checked_int_mul(1, int64_t{c.qk_nope_head_dim} + c.qk_rope_head_dim, "config: qk_nope_head_dim + qk_rope_head_dim");
    checked_int_mul(c.n_heads, qk, "config: n_heads x (qk_nope_head_dim + qk_rope_head_dim)");
    checked_int_mul(c.n_heads, int64_t{c.qk_nope_head_dim} + c.v_head_dim, "config: n_heads x (qk_nope_head_dim + v_head_dim)");
    checked_int_mul(c.n_heads, c.v_head_dim, "config: n_heads x v_head_dim");
    checked_int_mul(1, int64_t{c.kv_lora_rank} + c.qk_rope_head_dim, "config: kv_lora_rank + qk_rope_head_dim");
    checked_int_mul(2, c.dim, "config: 2 x dim");
    checked_int_mul(c.n_shared_experts, c.moe_inter_dim, "config: n_shared_experts x moe_inter_dim");
}

// With INT4, every FFN matrix is quantized in groups of 32 along its input.
void check_int4_widths(const ModelConfig& c) {
    const auto multiple_of_32 = [](const char* field, int64_t v) {
        if (v % 32 != 0)
            throw std::runtime_error(std::string("config.") + field + ": " + std::to_string(v) +
                                     " is not a multiple of 32 (INT4 groups of 32 along each quantized input)");
    };
    multiple_of_32("dim", c.dim);
    if (c.n_dense_layers > 0) multiple_of_32("inter_dim", c.inter_dim);
    if (c.has_moe()) multiple_of_32("moe_inter_dim", c.moe_inter_dim);
}

}  // namespace

ModelConfig ModelConfig::from_json(const Json& j, bool int4) {
    if (!j.is_object()) throw std::runtime_error(std::string("config: expected an object, got ") + j.type_name());
    ModelConfig c;
    for (const auto& kv : j.members()) {
        const std::string& key = kv.first;
        bool known = key == "name" || key == "rope_scaling";
        for (const IntField& f : kIntFields) known = known || key == f.key;
        for (const FloatField& f : kFloatFields) known = known || key == f.key;
        if (!known) throw std::runtime_error("config." + printable(key) + ": unknown field (this engine does not implement it)");
    }
    if (const Json* name = j.find("name")) {
        if (!name->is_string()) throw std::runtime_error(std::string("config.name: expected a string, got ") + name->type_name());
        c.name = printable(name->as_string(), 64);
    }
    for (const IntField& f : kIntFields) {
        const Json* v = j.find(f.key);
        if (!v) {
            if (f.required) throw std::runtime_error(std::string("config.") + f.key + ": missing");
            c.*f.member = f.fallback;
            continue;
        }
        if (!v->is_integer())
            throw std::runtime_error(std::string("config.") + f.key + ": expected an integer in [" + std::to_string(f.min) + ", " +
                                     std::to_string(f.max) + "], got " + describe(*v));
        const int64_t x = v->as_int();
        if (x < f.min || x > f.max)
            throw std::runtime_error(std::string("config.") + f.key + ": " + std::to_string(x) + " is outside [" +
                                     std::to_string(f.min) + ", " + std::to_string(f.max) + "]");
        c.*f.member = static_cast<int>(x);
    }
    for (const FloatField& f : kFloatFields) {
        const Json* v = j.find(f.key);
        if (!v) {
            c.*f.member = f.fallback;
            continue;
        }
        if (!v->is_number()) throw std::runtime_error(std::string("config.") + f.key + ": expected a number, got " + v->type_name());
        const double x = v->as_number();
        if (!(x > f.min && x <= f.max))  // also false for NaN
            throw std::runtime_error(std::string("config.") + f.key + ": " + describe(*v) + " is outside (" + Json(f.min).dump() +
                                     ", " + Json(f.max).dump() + "]");
        c.*f.member = static_cast<float>(x);
    }
    if (const Json* scaling = j.find("rope_scaling"); scaling && !scaling->is_null())
        c.rope_scaling = rope_scaling_from_json(*scaling);
    for (const Relation& r : kRelations)
        if (!r.holds(c)) throw std::runtime_error(std::string("config.") + r.fields + ": needs " + r.rule);
    check_derived_sizes(c);
    if (int4) check_int4_widths(c);
    return c;
}

uint64_t model_buffer_bytes(const ModelConfig& c, int drafter_block, int max_batch) {
    const auto mul = [](uint64_t a, uint64_t b) { return checked_mul(a, b, "memory estimate"); };
    const auto add = [](uint64_t a, uint64_t b) { return checked_add(a, b, "memory estimate"); };
    const uint64_t M = static_cast<uint64_t>(std::max(max_batch, 1));
    const uint64_t D = static_cast<uint64_t>(c.dim), V = static_cast<uint64_t>(c.vocab_size);
    const uint64_t H = static_cast<uint64_t>(c.n_heads);
    const uint64_t qk = static_cast<uint64_t>(c.qk_nope_head_dim) + static_cast<uint64_t>(c.qk_rope_head_dim);
    const uint64_t row_width = static_cast<uint64_t>(c.kv_lora_rank) + static_cast<uint64_t>(c.qk_rope_head_dim);
    const uint64_t ffn_width = static_cast<uint64_t>(std::max(c.inter_dim, c.n_shared_experts * c.moe_inter_dim));
    const uint64_t experts = static_cast<uint64_t>(std::max(c.n_routed_experts, 1));
    const uint64_t top_k = static_cast<uint64_t>(std::max(c.n_activated_experts, 1));
    const uint64_t block = static_cast<uint64_t>(std::max(drafter_block, 1));
    // KV caches: max_seq_len + max_batch rows per layer.
    uint64_t floats = mul(mul(static_cast<uint64_t>(c.n_layers), add(static_cast<uint64_t>(c.max_seq_len), M)), row_width);
    // Per-row forward buffers (Model::Model), plus the CPU backend's per-call copies (moe_ffn's
    // per-slot outputs and gathered rows, matmul_w4a16's regrouped rows).
    uint64_t per_row = add(mul(D, 6), static_cast<uint64_t>(std::max(c.q_lora_rank, 1)));
    per_row = add(per_row, mul(H, qk));
    per_row = add(per_row, mul(H, static_cast<uint64_t>(c.v_head_dim)));
    per_row = add(per_row, mul(ffn_width, 2));
    per_row = add(per_row, add(experts, mul(top_k, 2)));
    per_row = add(per_row, V);
    per_row = add(per_row, mul(add(top_k, 2), D));
    per_row = add(per_row, mul(static_cast<uint64_t>(std::max(c.moe_inter_dim, c.inter_dim)), 2));
    per_row = add(per_row, std::max({D, ffn_width, H * static_cast<uint64_t>(c.v_head_dim)}));
    per_row = add(per_row, row_width);  // kv_new_, the forward's latent rows before kv_append
    floats = add(floats, mul(M, per_row));
    // The drafter: feature [2D], logits [block][V], and the decode loop's top-K lists (K <= V);
    // a lowrank_head drafter's v f [r <= 2D] and u_j (v f) [block][D].
    floats = add(floats, add(mul(D, 2), mul(mul(block, V), 3)));
    floats = add(floats, add(mul(D, 2), mul(block, D)));
    // One 256-byte-aligned allocation per buffer at most 256 bytes over.
    const uint64_t buffers = add(mul(static_cast<uint64_t>(c.n_layers), 4), 64);
    return add(mul(floats, 4), mul(buffers, 256));
}

}  // namespace kd
