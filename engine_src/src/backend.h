// backend.h: the op interface between the model / decode loops and a compute backend.
//
// The model (model.cpp) and the decode loops (decode.cpp) call nothing but this interface.
// backend_cpu.cpp implements it in plain C++; src/cuda/*.cu implements it in CUDA. A new op
// is added here (additively) with its contract, then to every backend and to tests/test_ops.cpp.
//
// Conventions that hold for every op
// ----------------------------------
// * Memory. Every float / int32 pointer an op takes is a *backend pointer*: it points into a
//   buffer from alloc() (on CUDA: device memory), possibly offset by whole elements. Pointers
//   named `*_host` are ordinary host memory, read during the call only (the backend copies what
//   it needs before returning). Buffers are owned by whoever called alloc() and released with
//   release(); ops never allocate buffers the caller sees (scratch is the backend's business).
// * Layout. Row-major, fp32 unless stated. A matrix "W[N][K]" is N rows of K contiguous floats,
//   i.e. the bundle's `W[out][in]`. "M rows" means M independent activations (batch / tree nodes).
// * Ordering. Ops run in call order. upload/copy/ops may be asynchronous; download() and every
//   op that writes a `*_host` output return only when the result is on the host.
// * Aliasing. Unless an op says "in place allowed", outputs must not overlap inputs.
// * Determinism (the DDTree == AR invariant). The value computed for row m must depend only on
//   row m's inputs, never on M or on the other rows: the same reduction order, the same code
//   path for M = 1 and M = 1 + B, no split-K choice that varies with M. Masked attention entries
//   contribute exactly nothing (they are skipped, not added as a large negative number). Ties
//   in every argmax / top-k go to the lower index.
// * Errors. A backend throws std::runtime_error with a message naming the op and the problem.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>

namespace kd {

// Which cache rows a batch row may attend to. Batch row i (0 <= i < M) has just been written
// to cache row `committed + i`. It sees every committed row [0, committed), then the rows of its
// ancestors, then itself: ancestors are found by following parent_host[i] (< i, or -1 for none)
// up to -1. A causal chain (prefill, or M = 1 in AR) is parent_host[i] = i - 1; a DDTree verify
// batch is the tree's parent array (root at 0 with parent -1).
// Visit order inside one row is ascending cache row, so a row's softmax sums in the same order
// whether it is verified in a tree or decoded alone after compaction.
// `committed` is a host input like the `*_host` arrays: a unit (Backend::begin_unit) may stage
// it as {&vis.committed, 1}, and a recorded unit then reads it afresh at each replay.
struct Visibility {
    int committed = 0;                  // rows of the cache visible to every batch row
    const int32_t* parent_host = nullptr;  // [M] parent index inside the batch, -1 for none
    // The cache's rows (committed + M never exceeds it), or 0 when unknown: a backend may size a
    // call for it, so that the same call stays valid while only `committed` changes.
    int capacity = 0;
};

// MLA shapes (DeepSeek-V3 names). Cache row layout: [c (d_c) | k_rope (d_r)], fp32,
// row stride d_c + d_r; `scale` is tau = (d_n + d_r)^-1/2.
struct MlaDims {
    int n_heads = 0;   // H
    int d_c = 0;       // kv_lora_rank
    int d_n = 0;       // qk_nope_head_dim
    int d_r = 0;       // qk_rope_head_dim
    int d_v = 0;       // v_head_dim
    float scale = 0;
};

// RoPE frequencies of a model (rope.h builds them from the config, plain or YaRN-scaled): pair i
// of a vector at position p turns by the angle p * inv_freq[i], and cos / sin are multiplied by
// `magnitude` (YaRN's cos/sin factor; exactly 1 without scaling).
struct RopeTable {
    static constexpr int kMaxPairs = 64;  // d_r up to 128 (DeepSeek-V3 and Kimi-K2: 64)
    double inv_freq[kMaxPairs] = {};
    double magnitude = 1;
};

// noaux_tc routing parameters.
struct MoeRouting {
    int n_experts = 0;     // E
    int top_k = 0;         // experts per row
    int n_groups = 1;      // expert groups (E % n_groups == 0)
    int topk_groups = 1;   // groups kept
    float route_scale = 1;
};

// The routed experts of one MoE layer, stacked so a backend can run them as one grouped op.
// All pointers are backend pointers. fp32: w1, w3 [E][inter][dim], w2 [E][dim][inter].
// int4: each expert's matrices stored by upload_w4a16, expert e of q1, q3 at e * w4a16_words(inter,
// dim) (s1, s3 at e * w4a16_scales(inter, dim)), of q2 at e * w4a16_words(dim, inter) (s2 likewise).
// The unused set of pointers is null.
struct ExpertWeights {
    int n_experts = 0;
    int dim = 0;
    int inter = 0;
    bool int4 = false;
    const float* w1 = nullptr; const float* w2 = nullptr; const float* w3 = nullptr;
    const int32_t* q1 = nullptr; const int32_t* q2 = nullptr; const int32_t* q3 = nullptr;
    const float* s1 = nullptr; const float* s2 = nullptr; const float* s3 = nullptr;
    // The stacks hold one more expert, n_experts, applied to every row (the shared expert).
    bool shared = false;
};

// What a backend queued on its device (backend.cpp's difference gives a span's share): kernels
// run, whether launched alone or replayed in a graph; host submissions (kernel launches on their
// own, graph launches); copies by direction; host waits for the device. The CPU backend counts
// nothing.
struct BackendCounters {
    long kernels = 0, launches = 0, graph_launches = 0;
    long h2d = 0, d2h = 0, d2d = 0;
    long syncs = 0;
};
BackendCounters operator-(const BackendCounters& a, const BackendCounters& b);

// A host array of int32 values that an op of a unit will get as a `*_host` input (begin_unit).
struct HostInts {
    const int32_t* data = nullptr;
    int n = 0;
};

// tree_accept's result, int32 values in backend memory: [kCount] n, the accepted nodes (root
// included, >= 1); [kLast] the last accepted node; [kBonus] post of it (the next bonus token);
// then path[M] from kPath (the first n valid: the accepted node indices, ascending from 0), then
// post[M] (the argmax of every node's logits).
struct AcceptedPath {
    static constexpr int kCount = 0, kLast = 1, kBonus = 2, kPath = 3;
    static constexpr int post(int M) { return kPath + M; }
    static constexpr int size(int M) { return kPath + 2 * M; }
};

class Backend {
public:
    virtual ~Backend() = default;

    // "cpu" or "cuda".
    virtual std::string name() const = 0;
    // One line describing the device (CPU model and threads, or GPU name, CC, memory, driver).
    virtual std::string device_description() const = 0;

    // ---- memory ---------------------------------------------------------------------------
    // alloc: a zero-filled buffer of nbytes (aligned to at least 256 bytes). Never returns null;
    // throws when out of memory. release(nullptr) is a no-op.
    virtual void* alloc(size_t nbytes) = 0;
    virtual void release(void* buf) = 0;
    virtual void upload(void* dst, const void* src_host, size_t nbytes) = 0;
    virtual void download(void* dst_host, const void* src, size_t nbytes) = 0;
    // Backend-to-backend copy; the ranges must not overlap.
    virtual void copy(void* dst, const void* src, size_t nbytes) = 0;
    // Waits for all queued work (used around timings).
    virtual void synchronize() = 0;

    // ---- units: host inputs sent at once, and recorded op sequences (optional) ----------------
    // A unit is a run of ops the model issues together (a forward, a DDTree round). begin_unit
    // names every `*_host` array its ops will get; the arrays must keep their values until
    // end_unit. A backend may send them to its memory in one copy, and an op that then gets one
    // of them (the same pointer, at most as many values) reads that copy. With record_key >= 0
    // a backend may also record the unit's ops instead of running them, run the recording at
    // end_unit, and for a later unit of the same key run the recording again instead of its ops:
    // so the ops issue nothing that waits for the device (no download, synchronize or
    // argmax), and a unit with the same key issues the same ops with the same arguments, only the
    // values in its staged arrays differ. end_unit(false) closes a unit whose op threw (its work
    // is dropped). Units do not nest. The CPU backend ignores both.
    virtual void begin_unit(std::initializer_list<HostInts> inputs, int record_key) {
        (void)inputs;
        (void)record_key;
    }
    virtual void end_unit(bool completed) { (void)completed; }
    virtual BackendCounters counters() const { return {}; }

    // ---- element-wise and row ops -----------------------------------------------------------
    // out[m][:] = table[tokens_host[m]][:] for m < M; table [V][dim]; out row stride out_stride
    // (>= dim; lets the drafter feature [h_T ; embed[b]] be assembled in place).
    virtual void embedding(float* out, int out_stride, const float* table, int dim,
                           const int32_t* tokens_host, int M) = 0;

    // RMSNorm over the first n values of each row: out[m][j] = x[m][j] / sqrt(mean_j x^2 + eps)
    // * w[j]. Rows are x_stride / out_stride apart (>= n). In place allowed (out == x, same stride).
    // The mean is an fp32 sum in ascending j divided by n.
    virtual void rmsnorm(float* out, int out_stride, const float* x, int x_stride,
                         const float* w, int M, int n, float eps) = 0;

    // RoPE, in place, on adjacent pairs. For each row m and each of n_vec vectors v, the d_r
    // values at x + m*row_stride + v*vec_stride + offset are rotated: for i < d_r/2 (<= kMaxPairs),
    // with angle = pos_host[m] * table.inv_freq[i] in double, cos = cos(angle) * table.magnitude
    // and sin likewise, each computed in double and rounded to float,
    // (a, b) = (x[2i], x[2i+1]) -> (a cos - b sin, a sin + b cos).
    // q: n_vec = H, vec_stride = d_n + d_r, offset = d_n. kv: n_vec = 1, offset = d_c.
    virtual void rope(float* x, int M, int row_stride, int n_vec, int vec_stride, int offset,
                      int d_r, const int32_t* pos_host, const RopeTable& table) = 0;

    // out[i] = silu(a[i]) * b[i] for i < n; silu(a) = a / (1 + exp(-a)). In place allowed (out == a).
    virtual void silu_mul(float* out, const float* a, const float* b, size_t n) = 0;

    // out[i] = a[i] + b[i] for i < n (the residual add). In place allowed (out == a or b).
    virtual void add(float* out, const float* a, const float* b, size_t n) = 0;

    // ---- matmuls ----------------------------------------------------------------------------
    // y[M][N] = x[M][K] W[N][K]^T (+ bias[N] when bias is not null), fp32 accumulation. No TF32.
    virtual void matmul_f32(float* y, const float* x, const float* W, const float* bias,
                            int M, int N, int K) = 0;

    // W4A16: y[M][N] = x[M][K] dequant(W)^T with fp32 activations and accumulation.
    // The bundle's layout: qw [N][K/8] int32: nibble k (bits 4k..4k+3, low nibble first) of word j
    // holds input 8j + k; sc [N][K/32] fp32: one scale per group of 32 inputs; weight =
    // (nibble - 8) * scale. K is a multiple of 32. matmul_w4a16 and moe_ffn read W as
    // upload_w4a16 stored it, in the backend's own layout: w4a16_words(N, K) int32 words at qw
    // and w4a16_scales(N, K) floats at sc (the CPU backend keeps the bundle's layout).
    virtual size_t w4a16_words(int N, int K) const { return static_cast<size_t>(N) * K / 8; }
    virtual size_t w4a16_scales(int N, int K) const { return static_cast<size_t>(N) * K / 32; }
    virtual void upload_w4a16(int32_t* qw, float* sc, const int32_t* qw_host, const float* sc_host, int N, int K) {
        upload(qw, qw_host, sizeof(int32_t) * w4a16_words(N, K));
        upload(sc, sc_host, sizeof(float) * w4a16_scales(N, K));
    }
    virtual void matmul_w4a16(float* y, const float* x, const int32_t* qw, const float* sc,
                              int M, int N, int K) = 0;

    // ---- attention and KV cache ---------------------------------------------------------------
    // The KV cache of one layer is a backend buffer [capacity][d_c + d_r] (layout in MlaDims).
    // Appending is done by the model: wkv_a, rmsnorm (first d_c) and rope (last d_r) make the
    // batch's rows in a buffer of its own, then kv_append writes them at rows [committed, committed + M).

    // cache rows [vis.committed, vis.committed + M) = rows [M][row_width] (vis.parent_host unused).
    virtual void kv_append(float* cache, int row_width, const Visibility& vis, const float* rows, int M) = 0;

    // Absorbed MLA attention for M query rows.
    // q [M][H][d_n + d_r] (q_rope already roped); wkv_b [H][d_n + d_v][d_c]; cache as above.
    // Per row m and head h: qh = W_UK^T q_nope (W_UK = wkv_b[h][:d_n]), for each visible cache
    // row t (Visibility, ascending t): s_t = scale (qh . c_t + q_rope . k_rope_t); p = softmax(s)
    // (max-subtracted, exp in fp32, sum in ascending t); u = sum_t p_t c_t;
    // out[m][h][:] = W_UV u (W_UV = wkv_b[h][d_n:]). out is [M][H * d_v].
    virtual void mla_attention(float* out, const float* q, const float* wkv_b, const float* cache,
                               const Visibility& vis, int M, const MlaDims& dims) = 0;

    // KV compaction after a DDTree verify, in `layers` caches spaced layer_stride floats apart
    // (cache l at caches + l * layer_stride): for j < n, cache row vis.committed + j = row
    // vis.committed + path[j] (row_width floats each), where n and path are tree_accept's result
    // `accepted` (a backend pointer: AcceptedPath layout). The path is strictly ascending with
    // path[j] >= j, so an ascending in-place copy is correct. Rows past committed + n are left as
    // they are (dead). vis.committed is a host input (a unit may stage it).
    virtual void kv_compact(float* caches, long layer_stride, int layers, int row_width, const Visibility& vis,
                            const int32_t* accepted) = 0;

    // dst[i][:width] = src[index[i]][:width] for i < n; index is a backend pointer (a value another
    // op wrote, e.g. tree_accept's last node); dst rows dst_stride apart, src rows width apart.
    virtual void gather_rows(float* dst, int dst_stride, const float* src, int width, const int32_t* index,
                             int n) = 0;

    // ---- MoE ----------------------------------------------------------------------------------
    // noaux_tc gate over logits [M][E] (= x gate.weight^T, from matmul_f32) and bias [E]:
    // s = sigmoid(logits); s' = s + bias; with n_groups > 1 a group's score is the sum of its
    // two largest s', the topk_groups best groups are kept and the others masked; the top_k
    // experts by s' among the kept ones are chosen. Outputs (backend pointers) for each row,
    // ordered by s' descending: idx [M][top_k] int32 and weight [M][top_k] =
    // s[idx] / sum(s[idx]) * route_scale. Ties everywhere go to the lower index.
    virtual void moe_gate(int32_t* idx, float* weight, const float* logits, const float* bias,
                          int M, const MoeRouting& routing) = 0;

    // The routed FFN of a whole MoE layer, one op so a GPU can run it grouped:
    // out[m] = sum_{j < top_k, in j order} weight[m][j] * E_e(x[m]), e = idx[m][j], then
    // + E_s(x[m]) with experts.shared (s = n_experts), where E_e(v) = w2_e (silu(w1_e v) *
    // (w3_e v)) in fp32 or W4A16 (ExpertWeights). x, out [M][dim]; out is overwritten. Each
    // E_e(x[m]) is computed exactly as matmul_* would for one row.
    virtual void moe_ffn(float* out, const float* x, const int32_t* idx, const float* weight,
                         int M, int top_k, const ExpertWeights& experts) = 0;

    // moe_gate(idx, weight, logits, bias, M, routing), then moe_ffn(out, x, idx, weight, M,
    // routing.top_k, experts): the same outputs (idx and weight too), as one op so a GPU can fuse
    // the routing's launches. routing.n_experts is experts.n_experts.
    virtual void moe_gate_ffn(float* out, const float* x, int32_t* idx, float* weight, const float* logits,
                              const float* bias, int M, const MoeRouting& routing, const ExpertWeights& experts) {
        moe_gate(idx, weight, logits, bias, M, routing);
        moe_ffn(out, x, idx, weight, M, routing.top_k, experts);
    }

    // ---- sampling / drafting -------------------------------------------------------------------
    // out_host[m] = argmax_j x[m][j], j < N; ties go to the lower j (a host output).
    virtual void argmax(int32_t* out_host, const float* x, int M, int N) = 0;

    // For each row m: lq = log_softmax(x[m]) (max-subtracted, sum of exp in ascending j, in
    // fp32); the K best entries by lq, descending (ties: lower token first), go to tokens[m][K]
    // and logprob[m][K] (backend pointers). K <= N.
    virtual void log_softmax_topk(int32_t* tokens, float* logprob, const float* x, int M, int N, int K) = 0;

    // Greedy acceptance of a verified draft tree of M nodes (node 0 the root, parents_host[i] < i,
    // -1 for the root): post[i] = argmax_j logits[i][j] (j < V, ties to the lower j); from the
    // root, while a child c of the current node carries tokens_host[c] == post[current] (the
    // first such c in index order), move there. Writes `accepted` (a backend pointer,
    // AcceptedPath::size(M) ints) without waiting: nothing reaches the host.
    virtual void tree_accept(int32_t* accepted, const float* logits, int V, const int32_t* tokens_host,
                             const int32_t* parents_host, int M) = 0;
};

// Backend names this binary can create, e.g. "cpu" or "cpu,cuda".
std::string available_backends();
// Creates "cpu" or "cuda" (throws std::runtime_error naming the backend when unavailable).
std::unique_ptr<Backend> make_backend(const std::string& name);

// Implemented by backend_cpu.cpp and (in builds with KD_WITH_CUDA) by src/cuda/.
std::unique_ptr<Backend> make_cpu_backend();
std::unique_ptr<Backend> make_cuda_backend();

}  // namespace kd
