// bundle.cpp: KDTR reader. Every failure names the file and what is wrong with it.
#include "bundle.h"

#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace kd {
namespace {

int int_field(const Json& j, const char* key, int fallback) {
    return j.has(key) ? static_cast<int>(j.at(key).as_int()) : fallback;
}
float float_field(const Json& j, const char* key, float fallback) {
    return j.has(key) ? static_cast<float>(j.at(key).as_number()) : fallback;
}

double double_field(const Json& j, const char* key, double fallback) {
    return j.has(key) ? j.at(key).as_number() : fallback;
}

RopeScaling rope_scaling_from_json(const Json& j) {
    if (!j.is_object()) throw std::runtime_error("config: rope_scaling is not an object");
    const std::string type = j.has("type") ? j.at("type").as_string() : "";
    if (type != "yarn") throw std::runtime_error("config: rope_scaling type '" + type + "' is not supported (only 'yarn')");
    RopeScaling r;
    r.yarn = true;
    r.factor = double_field(j, "factor", 1);
    r.original_max_position_embeddings = int_field(j, "original_max_position_embeddings", 0);
    r.beta_fast = double_field(j, "beta_fast", 32);
    r.beta_slow = double_field(j, "beta_slow", 1);
    r.mscale = double_field(j, "mscale", 1);
    r.mscale_all_dim = double_field(j, "mscale_all_dim", 0);
    if (!(r.factor >= 1) || r.original_max_position_embeddings <= 0 || !(r.beta_fast > r.beta_slow && r.beta_slow > 0))
        throw std::runtime_error("config: rope_scaling needs factor >= 1, original_max_position_embeddings > 0 and "
                                 "beta_fast > beta_slow > 0");
    return r;
}

std::string shape_text(const std::vector<int64_t>& shape) {
    std::string s = "[";
    for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + "]";
}

uint64_t read_le(const uint8_t* p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
    return v;
}

}  // namespace

ModelConfig ModelConfig::from_json(const Json& j) {
    ModelConfig c;
    c.name = j.has("name") ? j.at("name").as_string() : "";
    c.vocab_size = int_field(j, "vocab_size", 0);
    c.dim = int_field(j, "dim", 0);
    c.n_layers = int_field(j, "n_layers", 0);
    c.n_dense_layers = int_field(j, "n_dense_layers", 0);
    c.n_heads = int_field(j, "n_heads", 0);
    c.q_lora_rank = int_field(j, "q_lora_rank", 0);
    c.kv_lora_rank = int_field(j, "kv_lora_rank", 0);
    c.qk_nope_head_dim = int_field(j, "qk_nope_head_dim", 0);
    c.qk_rope_head_dim = int_field(j, "qk_rope_head_dim", 0);
    c.v_head_dim = int_field(j, "v_head_dim", 0);
    c.inter_dim = int_field(j, "inter_dim", 0);
    c.moe_inter_dim = int_field(j, "moe_inter_dim", 0);
    c.n_routed_experts = int_field(j, "n_routed_experts", 0);
    c.n_shared_experts = int_field(j, "n_shared_experts", 0);
    c.n_activated_experts = int_field(j, "n_activated_experts", 0);
    c.n_expert_groups = int_field(j, "n_expert_groups", 1);
    c.n_limited_groups = int_field(j, "n_limited_groups", 1);
    c.route_scale = float_field(j, "route_scale", 1.0f);
    c.rope_theta = float_field(j, "rope_theta", 10000.0f);
    c.norm_eps = float_field(j, "norm_eps", 1e-6f);
    c.max_seq_len = int_field(j, "max_seq_len", 0);
    if (j.has("rope_scaling") && !j.at("rope_scaling").is_null()) c.rope_scaling = rope_scaling_from_json(j.at("rope_scaling"));
    const int required[] = {c.vocab_size, c.dim, c.n_layers, c.n_heads, c.kv_lora_rank, c.qk_nope_head_dim,
                            c.qk_rope_head_dim, c.v_head_dim, c.max_seq_len};
    for (int v : required)
        if (v <= 0) throw std::runtime_error("config: a required size field is missing or not positive");
    if (c.n_layers > c.n_dense_layers && (c.n_routed_experts <= 0 || c.n_activated_experts <= 0 ||
                                          c.n_routed_experts % c.n_expert_groups != 0))
        throw std::runtime_error("config: MoE layers need n_routed_experts > 0, n_activated_experts > 0 and "
                                 "n_routed_experts divisible by n_expert_groups");
    return c;
}

Bundle Bundle::load(const std::string& path) {
    const auto fail = [&](const std::string& what) -> std::runtime_error {
        return std::runtime_error("bundle " + path + ": " + what);
    };
    Bundle b;
    b.path = path;
    std::ifstream in(path, std::ios::binary);
    if (!in) throw fail("cannot open the file");
    std::ostringstream raw;
    raw << in.rdbuf();
    const std::string s = raw.str();
    b.bytes.assign(s.begin(), s.end());

    if (b.bytes.size() < 16) throw fail("truncated: " + std::to_string(b.bytes.size()) + " bytes, shorter than the 16-byte preamble");
    if (std::memcmp(b.bytes.data(), "KDTR", 4) != 0) throw fail("bad magic (expected 'KDTR'): not a KDTR bundle");
    const uint64_t version = read_le(b.bytes.data() + 4, 4);
    if (version != 1) throw fail("unsupported version " + std::to_string(version) + " (this engine reads version 1)");
    const uint64_t header_len = read_le(b.bytes.data() + 8, 8);
    if (header_len > b.bytes.size() - 16)
        throw fail("truncated: header length " + std::to_string(header_len) + " runs past the end of the file (" +
                   std::to_string(b.bytes.size()) + " bytes)");
    try {
        b.header = Json::parse(std::string(reinterpret_cast<const char*>(b.bytes.data() + 16), header_len));
    } catch (const std::exception& e) {
        throw fail(std::string("bad header, not JSON: ") + e.what());
    }
    const uint64_t data_start = (16 + header_len + 63) / 64 * 64;

    try {
        b.config = ModelConfig::from_json(b.header.at("config"));
        const std::string quant = b.header.at("quant").at("type").as_string();
        if (quant != "fp32" && quant != "int4") throw std::runtime_error("unknown quant type '" + quant + "'");
        b.int4 = quant == "int4";
        if (b.int4 && b.header.at("quant").has("group_size") && b.header.at("quant").at("group_size").as_int() != 32)
            throw std::runtime_error("int4 group_size must be 32");
        b.drafter_block = static_cast<int>(b.header.at("drafter").at("block_size").as_int());
        b.mask_token = static_cast<int>(b.header.at("drafter").at("mask_token").as_int());
        b.prompt = b.header.at("prompt").as_int_vector();
        if (b.header.has("data_bytes") && data_start + static_cast<uint64_t>(b.header.at("data_bytes").as_int()) > b.bytes.size())
            throw std::runtime_error("truncated: the data section should hold " +
                                     std::to_string(b.header.at("data_bytes").as_int()) + " bytes, the file has " +
                                     std::to_string(b.bytes.size() > data_start ? b.bytes.size() - data_start : 0));
        for (const Json& t : b.header.at("tensors").items()) {
            TensorView v;
            v.name = t.at("name").as_string();
            v.dtype = t.at("dtype").as_string();
            if (v.dtype != "f32" && v.dtype != "i32") throw std::runtime_error("tensor " + v.name + ": unknown dtype '" + v.dtype + "'");
            uint64_t count = 1;
            for (const Json& d : t.at("shape").items()) {
                v.shape.push_back(d.as_int());
                if (v.shape.back() < 0) throw std::runtime_error("tensor " + v.name + ": negative dimension");
                count *= static_cast<uint64_t>(v.shape.back());
            }
            const int64_t offset = t.at("offset").as_int();
            v.nbytes = static_cast<size_t>(t.at("nbytes").as_int());
            if (v.nbytes != 4 * count)
                throw std::runtime_error("tensor " + v.name + ": nbytes " + std::to_string(v.nbytes) + " does not match shape " + shape_text(v.shape));
            if (offset < 0 || offset % 64 != 0) throw std::runtime_error("tensor " + v.name + ": offset " + std::to_string(offset) + " is not a non-negative multiple of 64");
            if (data_start + static_cast<uint64_t>(offset) + v.nbytes > b.bytes.size())
                throw std::runtime_error("tensor " + v.name + " out of bounds: bytes [" + std::to_string(offset) + ", " +
                                         std::to_string(offset + static_cast<int64_t>(v.nbytes)) + ") of the data section run past the end of the file");
            v.data = b.bytes.data() + data_start + offset;
            b.tensors.push_back(std::move(v));
        }
    } catch (const std::exception& e) {
        const std::string what = e.what();
        throw fail(what.rfind("truncated", 0) == 0 || what.rfind("tensor", 0) == 0 ? what : "bad header: " + what);
    }
    return b;
}

bool Bundle::has(const std::string& name) const {
    for (const TensorView& t : tensors)
        if (t.name == name) return true;
    return false;
}

const TensorView& Bundle::get(const std::string& name, const std::string& dtype, const std::vector<int64_t>& shape) const {
    for (const TensorView& t : tensors) {
        if (t.name != name) continue;
        if (t.dtype != dtype || t.shape != shape)
            throw std::runtime_error("bundle " + path + ": tensor " + name + " is " + t.dtype + " " + shape_text(t.shape) +
                                     ", expected " + dtype + " " + shape_text(shape));
        return t;
    }
    throw std::runtime_error("bundle " + path + ": missing tensor " + name);
}

std::vector<int32_t> Bundle::golden() const {
    return header.has("golden") ? header.at("golden").as_int_vector() : std::vector<int32_t>{};
}

}  // namespace kd
