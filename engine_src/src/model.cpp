// model.cpp: weights upload and the forward pass, expressed only in backend ops.
#include "model.h"
#include "rope.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <stdexcept>

namespace kd {
namespace {

double now_seconds() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// A backend unit (backend.h begin_unit) open for one scope: closed as completed by done(), as
// dropped when an op throws first.
class Unit {
public:
    Unit(Backend& be, std::initializer_list<HostInts> inputs, int record_key) : be_(be) { be_.begin_unit(inputs, record_key); }
    ~Unit() {
        if (open_) be_.end_unit(false);
    }
    Unit(const Unit&) = delete;
    Unit& operator=(const Unit&) = delete;
    void done() {
        open_ = false;
        be_.end_unit(true);
    }

private:
    Backend& be_;
    bool open_ = true;
};

// Record keys of the models of this process: each model takes max_batch + 1 of them (one per
// row count), so two models never share a recording.
std::atomic<int> next_record_key{0};

}  // namespace

float* Model::scratch(size_t floats) {
    void* p = be_.alloc(std::max<size_t>(floats, 1) * sizeof(float));
    owned_.push_back(p);
    return static_cast<float*>(p);
}

const float* Model::load_f32(const Bundle& b, const std::string& name, const std::vector<int64_t>& shape) {
    const TensorView& t = b.get(name, "f32", shape);
    float* p = scratch(t.nbytes / sizeof(float));
    be_.upload(p, t.data, t.nbytes);
    return p;
}

// Quantised FFN matrices are stored as <name>.qw / <name>.sc in int4 bundles.
Linear Model::load_linear(const Bundle& b, const std::string& name, int out, int in) {
    Linear l;
    l.out = out;
    l.in = in;
    if (b.has(name + ".qw")) {
        if (in % 32 != 0)
            throw std::runtime_error("bundle " + b.path + ": tensor " + name + ".qw: INT4 needs an input width that is a multiple of 32, this one is " +
                                     std::to_string(in));
        const TensorView& qw = b.get(name + ".qw", "i32", {out, in / 8});
        const TensorView& sc = b.get(name + ".sc", "f32", {out, in / 32});
        auto* q = static_cast<int32_t*>(be_.alloc(sizeof(int32_t) * be_.w4a16_words(out, in)));
        owned_.push_back(q);
        float* s = scratch(be_.w4a16_scales(out, in));
        be_.upload_w4a16(q, s, static_cast<const int32_t*>(qw.data), static_cast<const float*>(sc.data), out, in);
        l.qw = q;
        l.sc = s;
    } else {
        l.w = load_f32(b, name, {out, in});
    }
    return l;
}

Model::Model(const Bundle& b, Backend& backend, int max_batch)
    : be_(backend), cfg_(b.config), int4_(b.int4), max_batch_(max_batch), rope_(rope_table(b.config)),
      softmax_scale_(softmax_scale(b.config)) {
    if (max_batch < 1) throw std::runtime_error("model: max_batch " + std::to_string(max_batch) + " is below 1");
    b.check_memory(max_batch);  // nothing is allocated for a run over the memory limit
    const ModelConfig& c = cfg_;
    const int D = c.dim, H = c.n_heads, V = c.vocab_size;
    const int qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
    const int row_width = c.kv_lora_rank + c.qk_rope_head_dim;
    cache_rows_ = c.max_seq_len + max_batch;
    record_key_base_ = next_record_key.fetch_add(max_batch + 1);
    const double upload_start = now_seconds();
    try {
        embed_ = load_f32(b, "embed", {V, D});
        norm_ = load_f32(b, "norm", {D});
        head_ = load_f32(b, "head", {V, D});
        drafter_block_ = b.drafter_block;
        drafter_rank_ = b.drafter_kind == "lowrank_head" ? b.drafter_rank : 0;  // kind and rank checked by the reader
        if (drafter_rank_ > 0) {
            drafter_v_ = load_f32(b, "drafter.v", {drafter_rank_, 2 * D});
            drafter_u_ = load_f32(b, "drafter.u", {drafter_block_, D, drafter_rank_});
        } else {
            drafter_w_ = load_f32(b, "drafter.w", {drafter_block_, V, 2 * D});
        }
        drafter_b_ = load_f32(b, "drafter.b", {drafter_block_, V});
        for (int i = 0; i < c.n_layers; ++i) {
            const std::string p = "layers." + std::to_string(i) + ".";
            LayerWeights L;
            L.attn_norm = load_f32(b, p + "attn_norm", {D});
            L.ffn_norm = load_f32(b, p + "ffn_norm", {D});
            if (c.q_lora_rank > 0) {
                L.wq_a = load_linear(b, p + "attn.wq_a", c.q_lora_rank, D);
                L.q_norm = load_f32(b, p + "attn.q_norm", {c.q_lora_rank});
                L.wq_b = load_linear(b, p + "attn.wq_b", H * qk, c.q_lora_rank);
            } else {
                L.wq = load_linear(b, p + "attn.wq", H * qk, D);
            }
            L.wkv_a = load_linear(b, p + "attn.wkv_a", row_width, D);
            L.kv_norm = load_f32(b, p + "attn.kv_norm", {c.kv_lora_rank});
            L.wkv_b = load_f32(b, p + "attn.wkv_b", {H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank});
            L.wo = load_linear(b, p + "attn.wo", D, H * c.v_head_dim);
            L.moe = i >= c.n_dense_layers;
            if (!L.moe) {
                L.w1 = load_linear(b, p + "ffn.w1", c.inter_dim, D);
                L.w2 = load_linear(b, p + "ffn.w2", D, c.inter_dim);
                L.w3 = load_linear(b, p + "ffn.w3", c.inter_dim, D);
            } else {
                const int E = c.n_routed_experts, I = c.moe_inter_dim, S = c.n_shared_experts * I;
                L.gate = load_linear(b, p + "ffn.gate.weight", E, D);
                L.gate_bias = load_f32(b, p + "ffn.gate.bias", {E});
                // A shared expert as wide as a routed one and stored like them joins their stacks
                // (moe_ffn runs it with them); any other goes through linear() as a dense FFN.
                const auto stored_like_experts = [&](const char* w) { return b.has(p + "ffn.shared." + w + ".qw") == b.int4; };
                const bool stack_shared =
                    S == I && stored_like_experts("w1") && stored_like_experts("w2") && stored_like_experts("w3");
                if (S > 0 && !stack_shared) {
                    L.w1 = load_linear(b, p + "ffn.shared.w1", S, D);
                    L.w2 = load_linear(b, p + "ffn.shared.w2", D, S);
                    L.w3 = load_linear(b, p + "ffn.shared.w3", S, D);
                }
                // Stack the experts: one [E (+ 1)][out][in] buffer per projection.
                ExpertWeights& ew = L.experts;
                ew.n_experts = E;
                ew.dim = D;
                ew.inter = I;
                ew.int4 = b.int4;
                ew.shared = stack_shared;
                const int n_sets = E + (stack_shared ? 1 : 0);
                const size_t per = static_cast<size_t>(I) * D;
                const char* names[3] = {"w1", "w2", "w3"};
                for (int k = 0; k < 3; ++k) {
                    const int out = k == 1 ? D : I, in = k == 1 ? I : D;
                    void* stacked = nullptr;
                    float* scales = nullptr;
                    if (b.int4) {
                        stacked = be_.alloc(n_sets * be_.w4a16_words(out, in) * sizeof(int32_t));
                        owned_.push_back(stacked);
                        scales = scratch(n_sets * be_.w4a16_scales(out, in));
                    } else {
                        stacked = scratch(n_sets * per);
                    }
                    for (int e = 0; e < n_sets; ++e) {
                        const std::string name = p + (e < E ? "ffn.experts." + std::to_string(e) + "." : std::string("ffn.shared.")) + names[k];
                        if (b.int4) {
                            const TensorView& qw = b.get(name + ".qw", "i32", {out, in / 8});
                            const TensorView& sc = b.get(name + ".sc", "f32", {out, in / 32});
                            be_.upload_w4a16(static_cast<int32_t*>(stacked) + e * be_.w4a16_words(out, in),
                                             scales + e * be_.w4a16_scales(out, in), static_cast<const int32_t*>(qw.data),
                                             static_cast<const float*>(sc.data), out, in);
                        } else {
                            const TensorView& w = b.get(name, "f32", {out, in});
                            be_.upload(static_cast<float*>(stacked) + e * per, w.data, w.nbytes);
                        }
                    }
                    if (b.int4) {
                        (k == 0 ? ew.q1 : k == 1 ? ew.q2 : ew.q3) = static_cast<const int32_t*>(stacked);
                        (k == 0 ? ew.s1 : k == 1 ? ew.s2 : ew.s3) = scales;
                    } else {
                        (k == 0 ? ew.w1 : k == 1 ? ew.w2 : ew.w3) = static_cast<const float*>(stacked);
                    }
                }
            }
            layers_.push_back(L);
        }
        be_.synchronize();  // the uploads may be asynchronous: their time is theirs, not the first forward's
        upload_seconds_ = now_seconds() - upload_start;
        // One buffer for every layer's cache: a compaction moves rows in all of them at once.
        cache_stride_ = static_cast<long>(cache_rows_) * row_width;
        caches_ = scratch(static_cast<size_t>(cache_stride_) * layers_.size());
        for (size_t i = 0; i < layers_.size(); ++i) layers_[i].cache = caches_ + static_cast<long>(i) * cache_stride_;
        const size_t M = static_cast<size_t>(max_batch);
        const int ffn_width = std::max(c.inter_dim, c.n_shared_experts * c.moe_inter_dim);
        const int top_k = std::max(c.n_activated_experts, 1);
        x_ = scratch(M * D);
        kv_new_ = scratch(M * row_width);
        xn_ = scratch(M * D);
        qa_ = scratch(M * std::max(c.q_lora_rank, 1));
        q_ = scratch(M * H * qk);
        attn_ = scratch(M * H * c.v_head_dim);
        tmp_ = scratch(M * D);
        ffn_a_ = scratch(M * ffn_width);
        ffn_b_ = scratch(M * ffn_width);
        gate_logits_ = scratch(M * std::max(c.n_routed_experts, 1));
        route_w_ = scratch(M * top_k);
        route_idx_ = reinterpret_cast<int32_t*>(scratch(M * top_k));
        moe_out_ = scratch(M * D);
        hidden_ = scratch(M * D);
        logits_ = scratch(M * V);
        feature_ = scratch(2 * static_cast<size_t>(D));
        draft_logits_ = scratch(static_cast<size_t>(drafter_block_) * V);
        if (drafter_rank_ > 0) {
            draft_z_ = scratch(static_cast<size_t>(drafter_rank_));
            draft_y_ = scratch(static_cast<size_t>(drafter_block_) * D);
        }
        const size_t draft_ints = 2 * static_cast<size_t>(drafter_block_) * std::min(V, max_batch);
        round_ints_ = reinterpret_cast<int32_t*>(scratch(draft_ints + AcceptedPath::size(max_batch)));
    } catch (...) {
        for (void* p : owned_) be_.release(p);
        throw;
    }
}

Model::~Model() {
    for (void* p : owned_) be_.release(p);
}

void Model::linear(float* y, const float* x, const Linear& l, int M) {
    if (l.qw) be_.matmul_w4a16(y, x, l.qw, l.sc, M, l.out, l.in);
    else be_.matmul_f32(y, x, l.w, nullptr, M, l.out, l.in);
}

void Model::attention(LayerWeights& L, const int32_t* pos_host, int M, const Visibility& vis) {
    const ModelConfig& c = cfg_;
    const int D = c.dim, H = c.n_heads, qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
    const int row_width = c.kv_lora_rank + c.qk_rope_head_dim;
    be_.rmsnorm(xn_, D, x_, D, L.attn_norm, M, D, c.norm_eps);
    if (c.q_lora_rank > 0) {
        linear(qa_, xn_, L.wq_a, M);
        be_.rmsnorm(qa_, c.q_lora_rank, qa_, c.q_lora_rank, L.q_norm, M, c.q_lora_rank, c.norm_eps);
        linear(q_, qa_, L.wq_b, M);
    } else {
        linear(q_, xn_, L.wq, M);
    }
    be_.rope(q_, M, H * qk, H, qk, c.qk_nope_head_dim, c.qk_rope_head_dim, pos_host, rope_);
    // Append: the batch's latent rows are made in kv_new_ and written at the committed length,
    // which the ops take from `vis` (no pointer here depends on it: see Backend::begin_unit).
    linear(kv_new_, xn_, L.wkv_a, M);
    be_.rmsnorm(kv_new_, row_width, kv_new_, row_width, L.kv_norm, M, c.kv_lora_rank, c.norm_eps);
    be_.rope(kv_new_, M, row_width, 1, row_width, c.kv_lora_rank, c.qk_rope_head_dim, pos_host, rope_);
    be_.kv_append(L.cache, row_width, vis, kv_new_, M);
    MlaDims dims;
    dims.n_heads = H;
    dims.d_c = c.kv_lora_rank;
    dims.d_n = c.qk_nope_head_dim;
    dims.d_r = c.qk_rope_head_dim;
    dims.d_v = c.v_head_dim;
    dims.scale = softmax_scale_;
    be_.mla_attention(attn_, q_, L.wkv_b, L.cache, vis, M, dims);
    linear(tmp_, attn_, L.wo, M);
    be_.add(x_, x_, tmp_, static_cast<size_t>(M) * D);
}

void Model::ffn(LayerWeights& L, int M) {
    const ModelConfig& c = cfg_;
    const int D = c.dim;
    const size_t n = static_cast<size_t>(M) * D;
    be_.rmsnorm(xn_, D, x_, D, L.ffn_norm, M, D, c.norm_eps);
    const auto swiglu = [&](float* out) {  // dense FFN / shared expert: w2 (silu(w1 x) * (w3 x))
        linear(ffn_a_, xn_, L.w1, M);
        linear(ffn_b_, xn_, L.w3, M);
        be_.silu_mul(ffn_a_, ffn_a_, ffn_b_, static_cast<size_t>(M) * L.w1.out);
        linear(out, ffn_a_, L.w2, M);
    };
    if (!L.moe) {
        swiglu(tmp_);
        be_.add(x_, x_, tmp_, n);
        return;
    }
    MoeRouting r;
    r.n_experts = c.n_routed_experts;
    r.top_k = c.n_activated_experts;
    r.n_groups = c.n_expert_groups;
    r.topk_groups = c.n_limited_groups;
    r.route_scale = c.route_scale;
    linear(gate_logits_, xn_, L.gate, M);
    be_.moe_gate_ffn(moe_out_, xn_, route_idx_, route_w_, gate_logits_, L.gate_bias, M, r, L.experts);
    if (L.w1.out > 0) {
        swiglu(tmp_);
        be_.add(moe_out_, moe_out_, tmp_, n);
    }
    be_.add(x_, x_, moe_out_, n);
}

void Model::check_batch(const int32_t* tokens_host, int M, const Visibility& vis) const {
    if (M < 1 || M > max_batch_)
        throw std::runtime_error("forward: batch of " + std::to_string(M) + " rows, this model takes 1.." + std::to_string(max_batch_));
    if (vis.committed + M > cache_rows_)
        throw std::runtime_error("forward: the KV cache holds " + std::to_string(cfg_.max_seq_len) +
                                 " committed tokens (max_seq_len); the sequence is too long");
    for (int m = 0; m < M; ++m)
        if (tokens_host[m] < 0 || tokens_host[m] >= cfg_.vocab_size)
            throw std::runtime_error("forward: token " + std::to_string(tokens_host[m]) + " outside the vocabulary [0, " +
                                     std::to_string(cfg_.vocab_size) + ")");
}

void Model::forward_ops(const int32_t* tokens_host, const int32_t* pos_host, int M, const Visibility& v) {
    const int D = cfg_.dim;
    if (profile && times.attention.empty()) {
        times.attention.assign(layers_.size(), 0.0);
        times.ffn.assign(layers_.size(), 0.0);
    }
    be_.embedding(x_, D, embed_, D, tokens_host, M);
    for (size_t i = 0; i < layers_.size(); ++i) {
        double t0 = 0;
        if (profile) { be_.synchronize(); t0 = now_seconds(); }
        attention(layers_[i], pos_host, M, v);
        if (profile) { be_.synchronize(); const double t1 = now_seconds(); times.attention[i] += t1 - t0; t0 = t1; }
        ffn(layers_[i], M);
        if (profile) { be_.synchronize(); times.ffn[i] += now_seconds() - t0; }
    }
    be_.rmsnorm(hidden_, D, x_, D, norm_, M, D, cfg_.norm_eps);
    be_.matmul_f32(logits_, hidden_, head_, nullptr, M, cfg_.vocab_size, D);
}

void Model::forward(const int32_t* tokens_host, const int32_t* pos_host, int M, const Visibility& vis) {
    check_batch(tokens_host, M, vis);
    // Every op gets these host inputs and the same arguments for a row count (recorded and
    // replayed where the backend does), except when profiling synchronises them.
    Visibility v = vis;
    v.capacity = cache_rows_;
    Unit unit(be_, {{tokens_host, M}, {pos_host, M}, {v.parent_host, M}, {&v.committed, 1}},
              profile ? -1 : record_key_base_ + M);
    forward_ops(tokens_host, pos_host, M, v);
    unit.done();
}

int Model::round_key(int M, int block, int K) {
    const auto it = round_keys_.find({M, block, K});
    if (it != round_keys_.end()) return it->second;
    const int key = next_record_key.fetch_add(1);
    round_keys_[{M, block, K}] = key;
    return key;
}

void Model::round(const int32_t* tokens_host, const int32_t* pos_host, int M, const Visibility& vis, int block, int K,
                  Round& out) {
    check_batch(tokens_host, M, vis);
    check_draft(block, K);
    const int D = cfg_.dim, V = cfg_.vocab_size;
    const int row_width = cfg_.kv_lora_rank + cfg_.qk_rope_head_dim;
    int32_t* accepted = round_ints_ + 2 * block * K;
    Visibility v = vis;
    v.capacity = cache_rows_;
    {
        Unit unit(be_, {{tokens_host, M}, {pos_host, M}, {v.parent_host, M}, {&v.committed, 1}},
                  profile ? -1 : round_key(M, block, K));
        forward_ops(tokens_host, pos_host, M, v);
        be_.tree_accept(accepted, logits_, V, tokens_host, v.parent_host, M);
        be_.kv_compact(caches_, cache_stride_, static_cast<int>(layers_.size()), row_width, v, accepted);
        // f = [h of the last accepted node ; embed[its post token]]: the next draft's input.
        be_.gather_rows(feature_, D, hidden_, D, accepted + AcceptedPath::kLast, 1);
        be_.gather_rows(feature_ + D, D, embed_, D, accepted + AcceptedPath::kBonus, 1);
        propose(block, K);
        unit.done();
    }
    fetch_round(block, K, AcceptedPath::size(M), out.draft_tokens, out.draft_logprobs);
    const int32_t* a = round_host_.data() + 2 * static_cast<size_t>(block) * K;
    const int n = a[AcceptedPath::kCount];
    bool sane = n >= 1 && n <= M && a[AcceptedPath::kPath] == 0 && a[AcceptedPath::kLast] == a[AcceptedPath::kPath + n - 1];
    for (int j = 1; sane && j < n; ++j) sane = a[AcceptedPath::kPath + j] > a[AcceptedPath::kPath + j - 1];
    if (!sane || a[AcceptedPath::kBonus] < 0 || a[AcceptedPath::kBonus] >= V)
        throw std::runtime_error("round: the backend's accepted path is not a path of the " + std::to_string(M) +
                                 "-node tree (" + std::to_string(n) + " nodes, bonus " + std::to_string(a[AcceptedPath::kBonus]) + ")");
    out.path.assign(a + AcceptedPath::kPath, a + AcceptedPath::kPath + n);
    out.bonus = a[AcceptedPath::kBonus];
}

void Model::check_draft(int block, int K) const {
    if (block < 1 || block > drafter_block_)
        throw std::runtime_error("draft: block size " + std::to_string(block) + " outside 1.." + std::to_string(drafter_block_) +
                                 " (the bundle's drafter block)");
    const int k_max = std::min(cfg_.vocab_size, max_batch_);
    if (K < 1 || K > k_max)
        throw std::runtime_error("draft: K = " + std::to_string(K) + " outside 1.." + std::to_string(k_max) +
                                 " (the vocabulary and the model's batch rows)");
}

void Model::propose(int block, int K) {
    const int D = cfg_.dim, V = cfg_.vocab_size;
    if (drafter_rank_ > 0) {
        // lowrank_head: z = v f, y_j = u_j z (the first `block` u_j are one [block * D][r] matrix),
        // logits_j = head y_j + b_j.
        be_.matmul_f32(draft_z_, feature_, drafter_v_, nullptr, 1, drafter_rank_, 2 * D);
        be_.matmul_f32(draft_y_, draft_z_, drafter_u_, nullptr, 1, block * D, drafter_rank_);
        be_.matmul_f32(draft_logits_, draft_y_, head_, nullptr, block, V, D);
        be_.add(draft_logits_, draft_logits_, drafter_b_, static_cast<size_t>(block) * V);
    } else {
        // The first `block` drafter rows are one [block * V][2D] matrix.
        be_.matmul_f32(draft_logits_, feature_, drafter_w_, drafter_b_, 1, block * V, 2 * D);
    }
    be_.log_softmax_topk(round_ints_, reinterpret_cast<float*>(round_ints_ + block * K), draft_logits_, block, V, K);
}

void Model::fetch_round(int block, int K, int accepted_ints, std::vector<int32_t>& tokens, std::vector<float>& logprobs) {
    const size_t n = static_cast<size_t>(block) * K;
    round_host_.resize(2 * n + static_cast<size_t>(accepted_ints));
    be_.download(round_host_.data(), round_ints_, sizeof(int32_t) * round_host_.size());
    tokens.assign(round_host_.begin(), round_host_.begin() + static_cast<long>(n));
    logprobs.resize(n);
    std::memcpy(logprobs.data(), round_host_.data() + n, sizeof(float) * n);
}

void Model::draft(const float* h_T, int32_t bonus, int block, int K, std::vector<int32_t>& tokens,
                  std::vector<float>& logprobs) {
    check_draft(block, K);
    const int D = cfg_.dim;
    // f = [h_T ; embed[b]]
    be_.copy(feature_, h_T, sizeof(float) * D);
    be_.embedding(feature_ + D, D, embed_, D, &bonus, 1);
    propose(block, K);
    fetch_round(block, K, 0, tokens, logprobs);
}

}  // namespace kd
