// model.h: the target transformer (DeepSeek-V3 semantics) and its drafter, on top of backend.h.
// The model owns its weights and per-layer latent KV caches in backend memory.
#pragma once

#include "backend.h"
#include "bundle.h"

#include <cstdint>
#include <vector>

namespace kd {

// A linear layer y = W x in fp32 (w) or W4A16 (qw, sc); backend pointers.
struct Linear {
    const float* w = nullptr;
    const int32_t* qw = nullptr;
    const float* sc = nullptr;
    int out = 0, in = 0;
};

struct LayerWeights {
    const float *attn_norm = nullptr, *ffn_norm = nullptr;
    Linear wq_a, wq_b, wq, wkv_a, wo;  // wq_a/wq_b with q_lora_rank > 0, else wq
    const float *q_norm = nullptr, *kv_norm = nullptr, *wkv_b = nullptr;
    bool moe = false;
    Linear w1, w2, w3;                 // dense FFN, or the shared expert of a MoE layer
    Linear gate;                       // MoE router [E][dim]
    const float* gate_bias = nullptr;
    ExpertWeights experts;
    float* cache = nullptr;            // [cache_rows][d_c + d_r]
};

// Seconds spent per layer, filled when Model::profile is on (the backend is synchronised around
// every part, so profiling slows the forward down).
struct LayerTimes {
    std::vector<double> attention, ffn;
};

class Model {
public:
    // max_batch: most rows one forward takes (prompt length, or 1 + tree budget).
    Model(const Bundle& bundle, Backend& backend, int max_batch);
    ~Model();
    Model(const Model&) = delete;
    Model& operator=(const Model&) = delete;

    const ModelConfig& config() const { return cfg_; }
    Backend& backend() { return be_; }
    int max_batch() const { return max_batch_; }
    int cache_rows() const { return cache_rows_; }
    int drafter_block() const { return drafter_block_; }

    // Runs M tokens through the target. Token m is written to cache row vis.committed + m and sits
    // at RoPE position pos_host[m]; it attends as Visibility describes. Afterwards hidden() holds
    // the final-normed states [M][dim] and logits() the logits [M][V] (backend pointers).
    void forward(const int32_t* tokens_host, const int32_t* pos_host, int M, const Visibility& vis);
    const float* hidden() const { return hidden_; }
    const float* logits() const { return logits_; }

    // Keeps cache rows start + keep_host[j] as rows start + j, j < n, in every layer.
    void compact(int start, const int32_t* keep_host, int n);

    // Drafter: from the final hidden state h_T (backend pointer, dim floats) and the bonus token,
    // the K best tokens and their log-probabilities for each of the first `block` depths,
    // [block][K] each, on the host.
    void draft(const float* h_T, int32_t bonus, int block, int K, std::vector<int32_t>& tokens,
               std::vector<float>& logprobs);

    bool profile = false;
    LayerTimes times;

private:
    void linear(float* y, const float* x, const Linear& l, int M);
    void attention(LayerWeights& L, const int32_t* pos_host, int M, const Visibility& vis);
    void ffn(LayerWeights& L, int M);
    Linear load_linear(const Bundle& b, const std::string& name, int out, int in);
    const float* load_f32(const Bundle& b, const std::string& name, const std::vector<int64_t>& shape);
    float* scratch(size_t floats);

    Backend& be_;
    ModelConfig cfg_;
    bool int4_ = false;
    int max_batch_ = 0, cache_rows_ = 0, drafter_block_ = 0;
    int record_key_base_ = 0;    // this model's forward of M rows is backend unit key base + M
    RopeTable rope_;             // the config's RoPE frequencies (plain or YaRN)
    float softmax_scale_ = 0;    // tau, with YaRN's correction
    std::vector<void*> owned_;  // every buffer this model allocated
    const float *embed_ = nullptr, *norm_ = nullptr, *head_ = nullptr;
    const float *drafter_w_ = nullptr, *drafter_b_ = nullptr;
    std::vector<LayerWeights> layers_;
    float *x_ = nullptr, *xn_ = nullptr, *qa_ = nullptr, *q_ = nullptr, *attn_ = nullptr, *tmp_ = nullptr;
    float *ffn_a_ = nullptr, *ffn_b_ = nullptr, *gate_logits_ = nullptr, *route_w_ = nullptr, *moe_out_ = nullptr;
    int32_t* route_idx_ = nullptr;
    float* kv_new_ = nullptr;    // [max_batch][d_c + d_r]: a forward's latent rows before kv_append
    float *hidden_ = nullptr, *logits_ = nullptr, *feature_ = nullptr, *draft_logits_ = nullptr;
};

}  // namespace kd
