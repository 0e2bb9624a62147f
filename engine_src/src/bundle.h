// bundle.h: the KDTR bundle loader, format versions 1 and 2 (docs/engine/bundle-format.md).
#pragma once

#include "file_read.h"
#include "json.h"
#include "sha256.h"

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace kd {

// What a bundle may ask for by default (weights, KV caches, scratch, the file itself): --max-memory.
constexpr uint64_t kDefaultMaxMemory = uint64_t{4} << 30;

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

    // Reads and checks a header's `config` (README.md, "Input validation"): each field against
    // its row of the field table in config.cpp (type, range, default), unknown fields refused,
    // then the relations between fields; with int4, the quantized widths are multiples of 32.
    // Throws std::runtime_error("config.<field>: <problem>").
    static ModelConfig from_json(const Json& j, bool int4);
    bool has_moe() const { return n_layers > n_dense_layers; }
};

// Bytes a Model of this config needs besides its weights for max_batch rows per forward: the KV
// caches, the forward's and the drafter's buffers and the decode loops' host vectors (an upper
// estimate of what Model::Model and the backends allocate). Checked arithmetic throughout.
uint64_t model_buffer_bytes(const ModelConfig& c, int drafter_block, int max_batch);

struct TensorView {
    std::string name;
    std::string dtype;            // "f32" or "i32"
    std::vector<int64_t> shape;
    const void* data = nullptr;   // into Bundle::bytes
    size_t nbytes = 0;
};

struct Bundle {
    std::string path;
    int version = 1;              // the format version: 1 or 2
    Json header;
    ModelConfig config;
    bool int4 = false;
    bool keep_fp32_dense = false;   // int4 with quant.keep_fp32 "dense": the dense layers' FFN stays f32
    bool keep_fp32_shared = false;  // ... "shared": the shared expert stays f32
    int drafter_block = 0;
    int mask_token = 0;
    std::string drafter_kind = "linear";  // drafter.kind: "linear" or "lowrank_head"
    int drafter_rank = 0;                 // drafter.rank of a lowrank_head drafter (else 0)
    Digest digest{};              // version 2: the bundle digest (its identity), checked
    std::vector<int32_t> prompt;
    FileBytes bytes;              // the whole file
    std::vector<TensorView> tensors;
    std::unordered_map<std::string, size_t> by_name;  // tensor name -> index in tensors
    uint64_t weight_bytes = 0;    // sum of the tensors' nbytes
    uint64_t max_memory = kDefaultMaxMemory;  // the limit it was loaded under
    // How loading went: seconds reading the file (load, on read_threads threads) and checking it
    // (from_bytes: the header, layout, hashes and finiteness).
    double read_seconds = 0, check_seconds = 0;
    size_t read_threads = 0;

    // Reads and validates a bundle before anything is allocated for it: the file size against
    // max_memory, the preamble (magic, version 1 or 2), the header (strict JSON, exactly the
    // format's keys), the config, quant (keep_fp32), drafter (kind, rank), tokens and tensor
    // table (docs/engine/scripts.md, "Input validation"); the table as a layout (tensors in order, 64-aligned,
    // data_bytes at the last one's end) holding exactly the config's tensor set (tensor_set.h);
    // the file exactly as long as the layout (v2: up to the end of the index); zero fill; the
    // hashes (v1: data_sha256; v2: the index's count, every tensor's sha256 in parallel threads,
    // the bundle digest); every f32 tensor finite; and the memory a run of the bundle's own
    // prompt needs against max_memory. Throws std::runtime_error("bundle <path>: <problem>").
    static Bundle load(const std::string& path, uint64_t max_memory = kDefaultMaxMemory);
    // The file's bytes (what load reads), its size checked against max_memory before anything is
    // allocated; read in parallel chunks (InputFile::read_all: *threads is how many threads ran).
    // Throws "bundle <path>: <problem>", a failed read naming its offset and errno text, a file
    // that shrank, grew or changed while read refused.
    static FileBytes read_bytes(const std::string& path, uint64_t max_memory, size_t* threads = nullptr);
    // The same from bytes already in memory (path only names them in errors).
    static Bundle from_bytes(const std::string& path, FileBytes bytes, uint64_t max_memory = kDefaultMaxMemory);

    // Bytes a run with max_batch rows per forward needs (the file, the weights, model_buffer_bytes);
    // throws naming the file when that is over max_memory.
    uint64_t check_memory(int max_batch) const;
    // A token list against this bundle's vocabulary; throws "<what>[i] = t is outside the vocabulary".
    void check_tokens(const std::vector<int32_t>& tokens, const std::string& what) const;

    bool has(const std::string& name) const;
    // The tensor, checked against the expected dtype and shape; throws naming file and tensor.
    const TensorView& get(const std::string& name, const std::string& dtype, const std::vector<int64_t>& shape) const;
    // The bundle's identity, as a manifest's `sha256` holds it: v1 the sha256 of the whole file,
    // v2 the bundle digest.
    std::string identity() const;
    // The golden tokens stored in the header: for tests only, never read while generating.
    std::vector<int32_t> golden() const;
};

}  // namespace kd
