// model.h: the target transformer (DeepSeek-V3 semantics) and its drafter, on top of backend.h.
// The model owns its weights and per-layer latent KV caches in backend memory.
#pragma once

#include "backend.h"
#include "bundle.h"

#include <array>
#include <cstdint>
#include <map>
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
    // Seconds the constructor took to put the bundle's weights in backend memory (the uploads,
    // the INT4 layout rewrite and allocations, synchronised), before its KV caches and buffers.
    double upload_seconds() const { return upload_seconds_; }

    // Runs M tokens through the target. Token m is written to cache row vis.committed + m and sits
    // at RoPE position pos_host[m]; it attends as Visibility describes. Afterwards hidden() holds
    // the final-normed states [M][dim] and logits() the logits [M][V] (backend pointers).
    void forward(const int32_t* tokens_host, const int32_t* pos_host, int M, const Visibility& vis);
    const float* hidden() const { return hidden_; }
    const float* logits() const { return logits_; }

    // Drafter: from the final hidden state h_T (backend pointer, dim floats) and the bonus token,
    // the K best tokens and their log-probabilities for each of the first `block` depths,
    // [block][K] each, on the host. K is at most min(vocab, max_batch).
    void draft(const float* h_T, int32_t bonus, int block, int K, std::vector<int32_t>& tokens,
               std::vector<float>& logprobs);

    // What a DDTree round brings back to the host.
    struct Round {
        std::vector<int32_t> path;          // the accepted tree nodes, root first (ascending)
        int32_t bonus = 0;                  // the target's token after the last accepted node
        std::vector<int32_t> draft_tokens;  // the next draft from there, as draft() gives it
        std::vector<float> draft_logprobs;
    };
    // A DDTree round in one backend unit (so one recording per M, block and K where the backend
    // records): forward() of the M tree nodes (vis.parent_host their parents), greedy acceptance
    // (Backend::tree_accept), every layer's cache compacted to the accepted path, then draft()
    // from the last accepted node's state and its post token, all without a host wait; then one
    // download brings back `out`.
    void round(const int32_t* tokens_host, const int32_t* pos_host, int M, const Visibility& vis, int block, int K,
               Round& out);

    bool profile = false;
    LayerTimes times;

private:
    void check_batch(const int32_t* tokens_host, int M, const Visibility& vis) const;
    void check_draft(int block, int K) const;
    void forward_ops(const int32_t* tokens_host, const int32_t* pos_host, int M, const Visibility& vis);
    void propose(int block, int K);  // drafter logits of feature_ and their top-K into round_ints_
    // Downloads the draft [block][K] and the next `accepted_ints` ints of round_ints_ into
    // round_host_ in one copy, and hands the draft out.
    void fetch_round(int block, int K, int accepted_ints, std::vector<int32_t>& tokens, std::vector<float>& logprobs);
    int round_key(int M, int block, int K);
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
    double upload_seconds_ = 0;
    std::vector<void*> owned_;  // every buffer this model allocated
    const float *embed_ = nullptr, *norm_ = nullptr, *head_ = nullptr;
    // The drafter (README.md, "The drafter"): linear, logits_j = w_j f + b_j with w [L][V][2D]; or
    // lowrank_head (drafter_rank_ > 0), logits_j = head (u_j (v f)) + b_j with v [r][2D], u [L][D][r].
    const float *drafter_w_ = nullptr, *drafter_b_ = nullptr, *drafter_v_ = nullptr, *drafter_u_ = nullptr;
    int drafter_rank_ = 0;
    float *draft_z_ = nullptr, *draft_y_ = nullptr;  // lowrank_head: v f [r] and u_j (v f) [L][D]
    std::vector<LayerWeights> layers_;
    float *x_ = nullptr, *xn_ = nullptr, *qa_ = nullptr, *q_ = nullptr, *attn_ = nullptr, *tmp_ = nullptr;
    float *ffn_a_ = nullptr, *ffn_b_ = nullptr, *gate_logits_ = nullptr, *route_w_ = nullptr, *moe_out_ = nullptr;
    int32_t* route_idx_ = nullptr;
    float* kv_new_ = nullptr;    // [max_batch][d_c + d_r]: a forward's latent rows before kv_append
    float *hidden_ = nullptr, *logits_ = nullptr, *feature_ = nullptr, *draft_logits_ = nullptr;
    float* caches_ = nullptr;    // every layer's KV cache, cache_stride_ floats apart
    long cache_stride_ = 0;
    // A round's results in backend memory, as one download: draft tokens [block][K], their
    // log-probabilities (float bits), then tree_accept's AcceptedPath; and their host copy.
    int32_t* round_ints_ = nullptr;
    std::vector<int32_t> round_host_;
    std::map<std::array<int, 3>, int> round_keys_;  // (M, block, K) -> record key
};

}  // namespace kd
