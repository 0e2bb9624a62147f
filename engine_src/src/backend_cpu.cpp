// backend_cpu.cpp: the reference implementation of backend.h in plain C++17.
// Every op processes rows one at a time with the loops of cpu_kernels.h, so a row's result is
// independent of how many rows share the call (the DDTree == AR invariant holds bit for bit).
#include "backend.h"
#include "cpu_kernels.h"
#include "tree.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <numeric>
#include <stdexcept>
#include <thread>
#include <vector>

namespace kd {
namespace {

std::string cpu_model_name() {
    std::ifstream in("/proc/cpuinfo");
    std::string line;
    while (std::getline(in, line)) {
        if (line.rfind("model name", 0) == 0) {
            const auto colon = line.find(':');
            if (colon != std::string::npos) return line.substr(colon + 2);
        }
    }
    return "unknown CPU";
}

// Throws unless every batch row's parent is below it (so ancestor walks end).
void check_parents(const Visibility& vis, int M) {
    for (int a = 0; a < M; ++a)
        if (vis.parent_host[a] >= a)
            throw std::runtime_error("mla_attention: parent of row " + std::to_string(a) + " is not below it");
}

// Cache rows visible to batch row i, ascending (committed prefix, ancestors, itself).
void visible_rows(std::vector<int>& rows, const Visibility& vis, int i) {
    rows.clear();
    for (int t = 0; t < vis.committed; ++t) rows.push_back(t);
    const size_t first_batch_row = rows.size();
    for (int a = i; a >= 0; a = vis.parent_host[a]) rows.push_back(vis.committed + a);
    std::reverse(rows.begin() + static_cast<long>(first_batch_row), rows.end());
}

// Threads for large matmuls: KD_THREADS, else the hardware's, at most 16.
int thread_count() {
    static const int n = [] {
        const char* env = std::getenv("KD_THREADS");
        const int hw = static_cast<int>(std::thread::hardware_concurrency());
        const int want = env && std::atoi(env) > 0 ? std::atoi(env) : hw;
        return std::max(1, std::min(want, 16));
    }();
    return n;
}

// Runs body(begin, end) over [0, n) in contiguous chunks, one per thread, when `work`
// (multiply-adds) is large enough to pay for starting threads. Each output element is still
// computed by one thread with the same code, so results do not depend on the split.
template <class Body>
void parallel_for(int n, double work, const Body& body) {
    const int threads = work < 2e6 ? 1 : std::min(thread_count(), n);
    if (threads <= 1) {
        body(0, n);
        return;
    }
    std::vector<std::thread> pool;
    const int chunk = (n + threads - 1) / threads;
    for (int t = 1; t < threads; ++t) {
        const int begin = t * chunk, end = std::min(n, begin + chunk);
        if (begin < end) pool.emplace_back([&body, begin, end] { body(begin, end); });
    }
    body(0, std::min(n, chunk));
    for (std::thread& th : pool) th.join();
}

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// Indices of the k largest values of v[0..n) (descending; ties: lower index first).
std::vector<int> top_k(const float* v, int n, int k) {
    std::vector<int> order(static_cast<size_t>(n));
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [v](int a, int b) { return v[a] > v[b] || (v[a] == v[b] && a < b); });
    order.resize(static_cast<size_t>(k));
    return order;
}

class CpuBackend final : public Backend {
public:
    std::string name() const override { return "cpu"; }

    std::string device_description() const override {
        return cpu_model_name() + ", " + std::to_string(std::thread::hardware_concurrency()) +
               " hardware threads (engine uses " +
               std::to_string(thread_count()) + ")";
    }

    void* alloc(size_t nbytes) override {
        void* p = std::aligned_alloc(256, (std::max<size_t>(nbytes, 1) + 255) / 256 * 256);
        if (!p) throw std::runtime_error("cpu alloc: out of memory for " + std::to_string(nbytes) + " bytes");
        std::memset(p, 0, nbytes);
        return p;
    }
    void release(void* buf) override { std::free(buf); }
    // nbytes 0 may come with null pointers, which memcpy must not see.
    void upload(void* dst, const void* src_host, size_t nbytes) override { if (nbytes) std::memcpy(dst, src_host, nbytes); }
    void download(void* dst_host, const void* src, size_t nbytes) override { if (nbytes) std::memcpy(dst_host, src, nbytes); }
    void copy(void* dst, const void* src, size_t nbytes) override { if (nbytes) std::memcpy(dst, src, nbytes); }
    void synchronize() override {}

    void embedding(float* out, int out_stride, const float* table, int dim, const int32_t* tokens_host,
                   int M) override {
        for (int m = 0; m < M; ++m)
            std::memcpy(out + static_cast<long>(m) * out_stride, table + static_cast<long>(tokens_host[m]) * dim,
                        sizeof(float) * static_cast<size_t>(dim));
    }

    void rmsnorm(float* out, int out_stride, const float* x, int x_stride, const float* w, int M, int n,
                 float eps) override {
        for (int m = 0; m < M; ++m) {
            const float* xr = x + static_cast<long>(m) * x_stride;
            float* yr = out + static_cast<long>(m) * out_stride;
            float ss = 0;
            for (int j = 0; j < n; ++j) ss += xr[j] * xr[j];
            const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
            for (int j = 0; j < n; ++j) yr[j] = xr[j] * inv * w[j];
        }
    }

    void rope(float* x, int M, int row_stride, int n_vec, int vec_stride, int offset, int d_r,
              const int32_t* pos_host, const RopeTable& table) override {
        if (d_r / 2 > RopeTable::kMaxPairs) throw std::runtime_error("rope: d_r = " + std::to_string(d_r) + " exceeds the table");
        std::vector<float> cs(static_cast<size_t>(d_r / 2)), sn(static_cast<size_t>(d_r / 2));
        for (int m = 0; m < M; ++m) {
            for (int i = 0; i < d_r / 2; ++i) {
                const double angle = pos_host[m] * table.inv_freq[i];
                cs[i] = static_cast<float>(std::cos(angle) * table.magnitude);
                sn[i] = static_cast<float>(std::sin(angle) * table.magnitude);
            }
            for (int v = 0; v < n_vec; ++v) {
                float* p = x + static_cast<long>(m) * row_stride + static_cast<long>(v) * vec_stride + offset;
                for (int i = 0; i < d_r / 2; ++i) {
                    const float a = p[2 * i], b = p[2 * i + 1];
                    p[2 * i] = a * cs[i] - b * sn[i];
                    p[2 * i + 1] = a * sn[i] + b * cs[i];
                }
            }
        }
    }

    void silu_mul(float* out, const float* a, const float* b, size_t n) override {
        for (size_t i = 0; i < n; ++i) out[i] = a[i] / (1.0f + std::exp(-a[i])) * b[i];
    }

    void add(float* out, const float* a, const float* b, size_t n) override {
        for (size_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
    }

    // Weight row outer, activation rows inner: the matrix streams through once for all M rows.
    void matmul_f32(float* y, const float* x, const float* W, const float* bias, int M, int N, int K) override {
        parallel_for(N, static_cast<double>(M) * N * K, [&](int n0, int n1) {
            for (int n = n0; n < n1; ++n) {
                const float* wr = W + static_cast<long>(n) * K;
                for (int m = 0; m < M; ++m) {
                    float v = cpu::dot(x + static_cast<long>(m) * K, wr, K);
                    if (bias) v += bias[n];
                    y[static_cast<long>(m) * N + n] = v;
                }
            }
        });
    }

    void matmul_w4a16(float* y, const float* x, const int32_t* qw, const float* sc, int M, int N, int K) override {
        if (K % 32 != 0) throw std::runtime_error("matmul_w4a16: K = " + std::to_string(K) + " is not a multiple of 32");
        std::vector<float> xt(static_cast<size_t>(M) * K);
        for (int m = 0; m < M; ++m) cpu::regroup_for_w4(&xt[static_cast<size_t>(m) * K], x + static_cast<long>(m) * K, K);
        parallel_for(N, static_cast<double>(M) * N * K, [&](int n0, int n1) {
            for (int n = n0; n < n1; ++n) {
                const int32_t* qr = qw + static_cast<long>(n) * (K / 8);
                const float* sr = sc + static_cast<long>(n) * (K / 32);
                for (int m = 0; m < M; ++m)
                    y[static_cast<long>(m) * N + n] = cpu::dot_w4(&xt[static_cast<size_t>(m) * K], qr, sr, K);
            }
        });
    }

    void mla_attention(float* out, const float* q, const float* wkv_b, const float* cache, const Visibility& vis,
                       int M, const MlaDims& d) override {
        const int q_stride = d.n_heads * (d.d_n + d.d_r);
        const int row_width = d.d_c + d.d_r;
        check_parents(vis, M);
        // Rows in parallel (a long prefill attends over thousands of rows), each computed by one
        // thread with the same loops. Index i takes rows from both ends (0, M-1, 1, M-2, ...) so
        // that contiguous chunks get equal work under a causal mask.
        const double work = static_cast<double>(M) * d.n_heads * (vis.committed + M) * (2 * d.d_c + d.d_r);
        parallel_for(M, work, [&](int i0, int i1) {
            std::vector<int> rows;
            std::vector<float> q_abs(static_cast<size_t>(d.d_c)), u(static_cast<size_t>(d.d_c)), scores;
            for (int i = i0; i < i1; ++i) {
                const int m = i % 2 == 0 ? i / 2 : M - 1 - i / 2;
                visible_rows(rows, vis, m);
                scores.resize(rows.size());
                for (int h = 0; h < d.n_heads; ++h) {
                    const float* q_nope = q + static_cast<long>(m) * q_stride + static_cast<long>(h) * (d.d_n + d.d_r);
                    const float* q_rope = q_nope + d.d_n;
                    const float* w_uk = wkv_b + static_cast<long>(h) * (d.d_n + d.d_v) * d.d_c;
                    const float* w_uv = w_uk + static_cast<long>(d.d_n) * d.d_c;
                    // q^ = W_UK^T q_nope, summed over j ascending.
                    std::fill(q_abs.begin(), q_abs.end(), 0.0f);
                    for (int j = 0; j < d.d_n; ++j)
                        for (int c = 0; c < d.d_c; ++c) q_abs[c] += w_uk[static_cast<long>(j) * d.d_c + c] * q_nope[j];
                    float best = -INFINITY;
                    for (size_t t = 0; t < rows.size(); ++t) {
                        const float* kv = cache + static_cast<long>(rows[t]) * row_width;
                        scores[t] = d.scale * (cpu::dot(q_abs.data(), kv, d.d_c) + cpu::dot(q_rope, kv + d.d_c, d.d_r));
                        best = std::max(best, scores[t]);
                    }
                    float total = 0;
                    for (float& s : scores) {
                        s = std::exp(s - best);
                        total += s;
                    }
                    std::fill(u.begin(), u.end(), 0.0f);
                    for (size_t t = 0; t < rows.size(); ++t) {
                        const float p = scores[t] / total;
                        const float* c_t = cache + static_cast<long>(rows[t]) * row_width;
                        for (int c = 0; c < d.d_c; ++c) u[c] += p * c_t[c];
                    }
                    cpu::matvec_f32(out + static_cast<long>(m) * d.n_heads * d.d_v + static_cast<long>(h) * d.d_v,
                                    u.data(), w_uv, d.d_v, d.d_c);
                }
            }
        });
    }

    void kv_append(float* cache, int row_width, const Visibility& vis, const float* rows, int M) override {
        if (M > 0)
            std::memcpy(cache + static_cast<long>(vis.committed) * row_width, rows,
                        sizeof(float) * static_cast<size_t>(M) * row_width);
    }

    void kv_compact(float* caches, long layer_stride, int layers, int row_width, const Visibility& vis,
                    const int32_t* accepted) override {
        const int n = accepted[AcceptedPath::kCount];
        const int32_t* keep = accepted + AcceptedPath::kPath;
        for (int j = 0; j < n; ++j)
            if (keep[j] < j || (j > 0 && keep[j] <= keep[j - 1]))
                throw std::runtime_error("kv_compact: the accepted path must be strictly ascending with path[j] >= j");
        for (int l = 0; l < layers; ++l) {
            float* cache = caches + l * layer_stride;
            for (int j = 0; j < n; ++j)
                if (keep[j] != j)
                    std::memcpy(cache + static_cast<long>(vis.committed + j) * row_width,
                                cache + static_cast<long>(vis.committed + keep[j]) * row_width,
                                sizeof(float) * static_cast<size_t>(row_width));
        }
    }

    void gather_rows(float* dst, int dst_stride, const float* src, int width, const int32_t* index, int n) override {
        for (int i = 0; i < n; ++i)
            std::memcpy(dst + static_cast<long>(i) * dst_stride, src + static_cast<long>(index[i]) * width,
                        sizeof(float) * static_cast<size_t>(width));
    }

    void moe_gate(int32_t* idx, float* weight, const float* logits, const float* bias, int M,
                  const MoeRouting& r) override {
        // The same routing checks as the CUDA backend's: top_k's partial_sort needs k <= n.
        if (r.n_experts <= 0 || r.n_groups <= 0 || r.n_experts % r.n_groups != 0 || r.top_k <= 0 || r.top_k > r.n_experts ||
            r.topk_groups <= 0 || r.topk_groups > r.n_groups)
            throw std::runtime_error("moe_gate: bad routing (experts " + std::to_string(r.n_experts) + ", groups " +
                                     std::to_string(r.n_groups) + ", top_k " + std::to_string(r.top_k) + ", kept groups " +
                                     std::to_string(r.topk_groups) + ")");
        const int E = r.n_experts, group_size = r.n_experts / r.n_groups;
        std::vector<float> s(static_cast<size_t>(E)), sel(static_cast<size_t>(E)), group_score(static_cast<size_t>(r.n_groups));
        for (int m = 0; m < M; ++m) {
            for (int e = 0; e < E; ++e) {
                s[e] = sigmoid(logits[static_cast<long>(m) * E + e]);
                sel[e] = s[e] + bias[e];
            }
            if (r.n_groups > 1) {
                for (int g = 0; g < r.n_groups; ++g) {
                    const std::vector<int> best2 = top_k(sel.data() + g * group_size, group_size, std::min(2, group_size));
                    float score = 0;
                    for (int e : best2) score += sel[g * group_size + e];
                    group_score[g] = score;
                }
                std::vector<bool> kept(static_cast<size_t>(r.n_groups), false);
                for (int g : top_k(group_score.data(), r.n_groups, r.topk_groups)) kept[g] = true;
                for (int e = 0; e < E; ++e)
                    if (!kept[e / group_size]) sel[e] = -INFINITY;
            }
            const std::vector<int> chosen = top_k(sel.data(), E, r.top_k);
            float total = 0;
            for (int e : chosen) total += s[e];
            for (int j = 0; j < r.top_k; ++j) {
                idx[static_cast<long>(m) * r.top_k + j] = chosen[j];
                weight[static_cast<long>(m) * r.top_k + j] = s[chosen[j]] / total * r.route_scale;
            }
        }
    }

    // Rows are grouped by expert so each expert's weights (dequantised once per weight row for
    // INT4) serve all rows routed to it; every row still gets exactly the one-row arithmetic.
    void moe_ffn(float* out, const float* x, const int32_t* idx, const float* weight, int M, int top_k,
                 const ExpertWeights& w) override {
        const int D = w.dim, I = w.inter;
        const size_t slots = static_cast<size_t>(M) * top_k;
        // Slot m * top_k + j routes row m to expert idx[m][j]; slot slots + m row m to the shared
        // expert (stacked as expert n_experts).
        const int n_sets = w.n_experts + (w.shared ? 1 : 0);
        std::vector<std::vector<int>> routed(static_cast<size_t>(n_sets));
        for (size_t slot = 0; slot < slots; ++slot) {
            const int e = idx[slot];
            if (e < 0 || e >= w.n_experts) throw std::runtime_error("moe_ffn: expert index " + std::to_string(e) + " out of range");
            routed[static_cast<size_t>(e)].push_back(static_cast<int>(slot));
        }
        if (w.shared)
            for (int m = 0; m < M; ++m) routed.back().push_back(static_cast<int>(slots) + m);
        const auto row_of = [&](int slot) { return slot < static_cast<int>(slots) ? slot / top_k : slot - static_cast<int>(slots); };
        std::vector<float> xs, a, b, ys((slots + (w.shared ? M : 0)) * static_cast<size_t>(D));  // each slot's output
        for (int e = 0; e < n_sets; ++e) {
            const std::vector<int>& rows = routed[static_cast<size_t>(e)];
            const int R = static_cast<int>(rows.size());
            if (R == 0) continue;
            xs.resize(static_cast<size_t>(R) * D);
            a.resize(static_cast<size_t>(R) * I);
            b.resize(static_cast<size_t>(R) * I);
            for (int r = 0; r < R; ++r)
                std::memcpy(&xs[static_cast<size_t>(r) * D], x + static_cast<long>(row_of(rows[r])) * D, sizeof(float) * D);
            const long up = static_cast<long>(e) * I * D;  // elements of one [I][D] (or [D][I]) expert matrix
            float* y = ys.data();
            if (w.int4) {
                matmul_w4a16(a.data(), xs.data(), w.q1 + up / 8, w.s1 + up / 32, R, I, D);
                matmul_w4a16(b.data(), xs.data(), w.q3 + up / 8, w.s3 + up / 32, R, I, D);
            } else {
                matmul_f32(a.data(), xs.data(), w.w1 + up, nullptr, R, I, D);
                matmul_f32(b.data(), xs.data(), w.w3 + up, nullptr, R, I, D);
            }
            silu_mul(a.data(), a.data(), b.data(), a.size());
            if (w.int4) matmul_w4a16(xs.data(), a.data(), w.q2 + up / 8, w.s2 + up / 32, R, D, I);
            else matmul_f32(xs.data(), a.data(), w.w2 + up, nullptr, R, D, I);
            for (int r = 0; r < R; ++r)
                std::memcpy(y + static_cast<long>(rows[r]) * D, &xs[static_cast<size_t>(r) * D], sizeof(float) * D);
        }
        for (int m = 0; m < M; ++m) {
            float* outr = out + static_cast<long>(m) * D;
            std::fill(outr, outr + D, 0.0f);
            for (int j = 0; j < top_k; ++j) {
                const float g = weight[static_cast<long>(m) * top_k + j];
                const float* y = &ys[(static_cast<size_t>(m) * top_k + j) * D];
                for (int k = 0; k < D; ++k) outr[k] += g * y[k];
            }
            if (w.shared) {
                const float* y = &ys[(slots + m) * D];
                for (int k = 0; k < D; ++k) outr[k] += y[k];
            }
        }
    }

    void argmax(int32_t* out_host, const float* x, int M, int N) override {
        for (int m = 0; m < M; ++m) {
            const float* r = x + static_cast<long>(m) * N;
            int best = 0;
            for (int j = 1; j < N; ++j)
                if (r[j] > r[best]) best = j;
            out_host[m] = best;
        }
    }

    void log_softmax_topk(int32_t* tokens, float* logprob, const float* x, int M, int N, int K) override {
        std::vector<float> lq(static_cast<size_t>(N));
        for (int m = 0; m < M; ++m) {
            const float* r = x + static_cast<long>(m) * N;
            const float best = *std::max_element(r, r + N);
            float total = 0;
            for (int j = 0; j < N; ++j) total += std::exp(r[j] - best);
            const float lse = best + std::log(total);
            for (int j = 0; j < N; ++j) lq[j] = r[j] - lse;
            const std::vector<int> order = top_k(lq.data(), N, K);
            for (int k = 0; k < K; ++k) {
                tokens[static_cast<long>(m) * K + k] = order[k];
                logprob[static_cast<long>(m) * K + k] = lq[order[k]];
            }
        }
    }

    void tree_accept(int32_t* accepted, const float* logits, int V, const int32_t* tokens_host,
                     const int32_t* parents_host, int M) override {
        int32_t* post = accepted + AcceptedPath::post(M);
        argmax(post, logits, M, V);
        const std::vector<int32_t> path = accept_path(tokens_host, parents_host, M, post);
        std::copy(path.begin(), path.end(), accepted + AcceptedPath::kPath);
        accepted[AcceptedPath::kCount] = static_cast<int32_t>(path.size());
        accepted[AcceptedPath::kLast] = path.back();
        accepted[AcceptedPath::kBonus] = post[path.back()];
    }
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace kd
