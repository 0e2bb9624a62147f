// test_ops.cpp: every backend op against a plain double-precision reference (NMSE thresholds,
// as ggml's test-backend-ops), the row-independence the DDTree == AR invariant needs (bit-exact),
// and the host-side DDTree pieces (heap tree vs brute force, greedy walk), SHA-256 and the
// bundle loader's parallel file read.
//
//   build/test_ops [--backend cpu|cuda|all]
//
// Prints one line per test: "ok <name> <detail>", "FAIL <name> <detail>" or "skip <name> <why>";
// exits 1 when any test failed.
#include "backend.h"
#include "file_read.h"
#include "rope.h"
#include "sha256.h"
#include "tree.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include <cstdlib>
#include <fcntl.h>
#include <unistd.h>

using namespace kd;

namespace {

int g_failed = 0;

void report(const std::string& name, bool ok, const std::string& detail) {
    std::printf("%s %s %s\n", ok ? "ok" : "FAIL", name.c_str(), detail.c_str());
    std::fflush(stdout);  // an abort later (a CUDA error thrown in a destructor) keeps the lines before it
    if (!ok) ++g_failed;
}

std::string fmt(const char* f, double v) {
    char buf[64];
    std::snprintf(buf, sizeof buf, f, v);
    return buf;
}

// Deterministic test data (SplitMix64).
struct Rng {
    uint64_t s;
    explicit Rng(uint64_t seed) : s(seed) {}
    uint64_t next() {
        uint64_t z = (s += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    }
    float uniform(float lo, float hi) { return lo + (hi - lo) * static_cast<float>(next() >> 40) / 16777216.0f; }
    std::vector<float> vec(size_t n, float scale = 1.0f) {
        std::vector<float> v(n);
        for (float& x : v) x = uniform(-scale, scale);
        return v;
    }
    int below(int n) { return static_cast<int>(next() % static_cast<uint64_t>(n)); }
};

double nmse(const std::vector<float>& got, const std::vector<double>& ref) {
    double num = 0, den = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
        num += (got[i] - ref[i]) * (got[i] - ref[i]);
        den += ref[i] * ref[i];
    }
    return den > 0 ? num / den : num;
}

// Backend buffers that free themselves; values move to and from host vectors.
class Buffers {
public:
    explicit Buffers(Backend& be) : be_(be) {}
    ~Buffers() {
        for (void* p : owned_) be_.release(p);
    }
    template <class T>
    T* put(const std::vector<T>& host) {
        void* p = be_.alloc(std::max<size_t>(host.size(), 1) * sizeof(T));
        owned_.push_back(p);
        be_.upload(p, host.data(), host.size() * sizeof(T));
        return static_cast<T*>(p);
    }
    template <class T>
    T* zeros(size_t n) { return put(std::vector<T>(n)); }
    // n_sets INT4 matrices [N][K] in the bundle's layout (qw, sc), stored one after the other
    // by upload_w4a16 as matmul_w4a16 and moe_ffn read them.
    std::pair<int32_t*, float*> put_w4a16(const std::vector<int32_t>& qw, const std::vector<float>& sc, int N, int K,
                                          int n_sets = 1) {
        const size_t words = be_.w4a16_words(N, K), scales = be_.w4a16_scales(N, K);
        auto* q = static_cast<int32_t*>(be_.alloc(sizeof(int32_t) * n_sets * words));
        owned_.push_back(q);
        auto* s = static_cast<float*>(be_.alloc(sizeof(float) * n_sets * scales));
        owned_.push_back(s);
        for (int e = 0; e < n_sets; ++e)
            be_.upload_w4a16(q + e * words, s + e * scales, qw.data() + static_cast<size_t>(e) * N * K / 8,
                             sc.data() + static_cast<size_t>(e) * N * K / 32, N, K);
        return {q, s};
    }
    template <class T>
    std::vector<T> get(const T* p, size_t n) {
        std::vector<T> host(n);
        be_.download(host.data(), p, n * sizeof(T));
        return host;
    }

private:
    Backend& be_;
    std::vector<void*> owned_;
};

// ---- plain references --------------------------------------------------------------------

std::vector<double> ref_matmul(const std::vector<float>& x, const std::vector<float>& W, const std::vector<float>* bias,
                               int M, int N, int K) {
    std::vector<double> y(static_cast<size_t>(M) * N);
    for (int m = 0; m < M; ++m)
        for (int n = 0; n < N; ++n) {
            double s = bias ? (*bias)[n] : 0.0;
            for (int k = 0; k < K; ++k) s += static_cast<double>(x[m * K + k]) * W[static_cast<size_t>(n) * K + k];
            y[static_cast<size_t>(m) * N + n] = s;
        }
    return y;
}

// Random W4A16 weights and their dequantised floats, written from the README's layout.
struct Quantized {
    std::vector<int32_t> qw;
    std::vector<float> sc, dequant;
};
Quantized random_int4(Rng& rng, int N, int K) {
    Quantized q;
    q.qw.resize(static_cast<size_t>(N) * K / 8);
    q.sc = rng.vec(static_cast<size_t>(N) * K / 32, 0.05f);
    q.dequant.resize(static_cast<size_t>(N) * K);
    for (int n = 0; n < N; ++n)
        for (int k = 0; k < K; ++k) {
            const int nib = 1 + rng.below(15);
            q.qw[(static_cast<size_t>(n) * K + k) / 8] |= static_cast<int32_t>(static_cast<uint32_t>(nib) << (4 * (k % 8)));
            q.dequant[static_cast<size_t>(n) * K + k] = static_cast<float>(nib - 8) * q.sc[(static_cast<size_t>(n) * K + k) / 32];
        }
    return q;
}

std::vector<int> ancestors_and_self(const std::vector<int32_t>& parent, int i) {
    std::vector<int> rows;
    for (int a = i; a >= 0; a = parent[a]) rows.push_back(a);
    std::reverse(rows.begin(), rows.end());
    return rows;
}

// Dense visibility (committed prefix + ancestor closure), then textbook softmax in double.
std::vector<double> ref_attention(const std::vector<float>& q, const std::vector<float>& wkv_b, const std::vector<float>& cache,
                                  int committed, const std::vector<int32_t>& parent, const MlaDims& d) {
    const int M = static_cast<int>(parent.size()), W = d.d_c + d.d_r, qs = d.n_heads * (d.d_n + d.d_r);
    std::vector<double> out(static_cast<size_t>(M) * d.n_heads * d.d_v);
    for (int m = 0; m < M; ++m) {
        std::vector<int> rows(static_cast<size_t>(committed));
        std::iota(rows.begin(), rows.end(), 0);
        for (int a : ancestors_and_self(parent, m)) rows.push_back(committed + a);
        for (int h = 0; h < d.n_heads; ++h) {
            const float* qn = &q[static_cast<size_t>(m) * qs + static_cast<size_t>(h) * (d.d_n + d.d_r)];
            const float* wuk = &wkv_b[static_cast<size_t>(h) * (d.d_n + d.d_v) * d.d_c];
            std::vector<double> qa(static_cast<size_t>(d.d_c), 0.0), s, u(static_cast<size_t>(d.d_c), 0.0);
            for (int j = 0; j < d.d_n; ++j)
                for (int c = 0; c < d.d_c; ++c) qa[c] += static_cast<double>(wuk[j * d.d_c + c]) * qn[j];
            double best = -1e300;
            for (int t : rows) {
                double v = 0;
                for (int c = 0; c < d.d_c; ++c) v += qa[c] * cache[static_cast<size_t>(t) * W + c];
                for (int r = 0; r < d.d_r; ++r) v += static_cast<double>(qn[d.d_n + r]) * cache[static_cast<size_t>(t) * W + d.d_c + r];
                s.push_back(v * d.scale);
                best = std::max(best, s.back());
            }
            double total = 0;
            for (double& v : s) total += (v = std::exp(v - best));
            for (size_t i = 0; i < rows.size(); ++i)
                for (int c = 0; c < d.d_c; ++c) u[c] += s[i] / total * cache[static_cast<size_t>(rows[i]) * W + c];
            const float* wuv = wuk + static_cast<size_t>(d.d_n) * d.d_c;
            for (int v = 0; v < d.d_v; ++v) {
                double o = 0;
                for (int c = 0; c < d.d_c; ++c) o += static_cast<double>(wuv[v * d.d_c + c]) * u[c];
                out[(static_cast<size_t>(m) * d.n_heads + h) * d.d_v + v] = o;
            }
        }
    }
    return out;
}

std::vector<int32_t> random_tree(Rng& rng, int M) {
    std::vector<int32_t> parent(static_cast<size_t>(M));
    parent[0] = -1;
    for (int i = 1; i < M; ++i) parent[i] = rng.below(i);
    return parent;
}

// ---- backend op tests ---------------------------------------------------------------------

void test_elementwise(Backend& be, const std::string& p) {
    Rng rng(1);
    Buffers buf(be);
    {  // embedding into a strided output
        const int V = 50, D = 24, M = 5, stride = 2 * D;
        const std::vector<float> table = rng.vec(static_cast<size_t>(V) * D);
        const std::vector<int32_t> tokens = {3, 0, 49, 3, 17};
        float* out = buf.zeros<float>(static_cast<size_t>(M) * stride);
        be.embedding(out, stride, buf.put(table), D, tokens.data(), M);
        const std::vector<float> got = buf.get(out, static_cast<size_t>(M) * stride);
        bool ok = true;
        for (int m = 0; m < M; ++m)
            for (int j = 0; j < stride; ++j)
                ok = ok && got[m * stride + j] == (j < D ? table[static_cast<size_t>(tokens[m]) * D + j] : 0.0f);
        report(p + "embedding", ok, "exact copy into strided rows");
    }
    {  // rmsnorm over the first n values of strided rows, out of place and in place
        const int M = 6, n = 40, stride = 56;
        const std::vector<float> x = rng.vec(static_cast<size_t>(M) * stride, 3.0f), w = rng.vec(n);
        std::vector<double> ref(static_cast<size_t>(M) * n);
        for (int m = 0; m < M; ++m) {
            double ss = 0;
            for (int j = 0; j < n; ++j) ss += static_cast<double>(x[m * stride + j]) * x[m * stride + j];
            for (int j = 0; j < n; ++j) ref[m * n + j] = x[m * stride + j] / std::sqrt(ss / n + 1e-6) * w[j];
        }
        float* xb = buf.put(x);
        float* out = buf.zeros<float>(static_cast<size_t>(M) * n);
        be.rmsnorm(out, n, xb, stride, buf.put(w), M, n, 1e-6f);
        const double e1 = nmse(buf.get(out, static_cast<size_t>(M) * n), ref);
        be.rmsnorm(xb, stride, xb, stride, buf.put(w), M, n, 1e-6f);
        const std::vector<float> inplace = buf.get(xb, static_cast<size_t>(M) * stride);
        std::vector<float> packed;
        bool tail_kept = true;
        for (int m = 0; m < M; ++m)
            for (int j = 0; j < stride; ++j) {
                if (j < n) packed.push_back(inplace[m * stride + j]);
                else tail_kept = tail_kept && inplace[m * stride + j] == x[m * stride + j];
            }
        const double e2 = nmse(packed, ref);
        report(p + "rmsnorm", e1 < 1e-7 && e2 < 1e-7 && tail_kept, "nmse=" + fmt("%.2e", std::max(e1, e2)));
    }
    {  // rope on per-head segments: plain (tiny's frequencies) and YaRN at k2mini's shape
        struct Case {
            const char* name;
            int d_r;
            double theta;
            RopeScaling yarn;
        };
        RopeScaling k2mini;  // DeepSeek-V3's scaling with a 512-position original context
        k2mini.yarn = true; k2mini.factor = 40; k2mini.original_max_position_embeddings = 512;
        k2mini.beta_fast = 32; k2mini.beta_slow = 1; k2mini.mscale = 1; k2mini.mscale_all_dim = 1;
        RopeScaling v2 = k2mini;  // mscale != mscale_all_dim: cos/sin scaled (DeepSeek-V2 style)
        v2.mscale = 0.707; v2.mscale_all_dim = 0;
        RopeScaling k2 = k2mini;  // Kimi-K2's: factor 32, original context 4096, beta_fast == beta_slow == 1
        k2.factor = 32; k2.original_max_position_embeddings = 4096; k2.beta_fast = 1; k2.beta_slow = 1;
        // Equal betas whose correction pair is -0.5: both ends clamp to pair 0, the zero-width ramp
        // the reference code widens by 0.001.
        RopeScaling step = k2mini;
        step.beta_fast = step.beta_slow = 512 / (2 * 3.14159265358979323846 * std::pow(10000.0, 2 * -0.5 / 32));
        const Case cases[] = {{"rope", 16, 10000.0, RopeScaling()}, {"rope.yarn_k2mini", 32, 10000.0, k2mini},
                              {"rope.yarn_mscale", 32, 10000.0, v2}, {"rope.yarn_k2", 64, 50000.0, k2},
                              {"rope.yarn_equal_ends", 32, 10000.0, step}};
        for (const Case& cs : cases) {
            const int M = 7, H = 3, d_n = 8, d_r = cs.d_r, vs = d_n + d_r, rs = H * vs;
            ModelConfig cfg;
            cfg.qk_nope_head_dim = d_n; cfg.qk_rope_head_dim = d_r; cfg.rope_theta = static_cast<float>(cs.theta);
            cfg.rope_scaling = cs.yarn;
            const RopeTable table = rope_table(cfg);
            // Hugging Face's DeepseekV3YarnRotaryEmbedding, written out again independently of rope.cpp.
            std::vector<double> freq(d_r / 2);
            double mag = 1;
            for (int i = 0; i < d_r / 2; ++i) freq[i] = 1.0 / std::pow(cs.theta, 2.0 * i / d_r);
            if (cs.yarn.yarn) {
                const auto dim_of = [&](double rot) {
                    return d_r * std::log(cs.yarn.original_max_position_embeddings / (rot * 2 * 3.14159265358979323846)) /
                           (2 * std::log(cs.theta));
                };
                const double lo = std::max(std::floor(dim_of(cs.yarn.beta_fast)), 0.0);
                double hi = std::min(std::ceil(dim_of(cs.yarn.beta_slow)), d_r - 1.0);
                if (lo == hi) hi += 0.001;
                for (int i = 0; i < d_r / 2; ++i) {
                    const double keep = 1.0 - std::min(std::max((i - lo) / (hi - lo), 0.0), 1.0);
                    freq[i] = freq[i] / cs.yarn.factor * (1 - keep) + freq[i] * keep;
                }
                const auto ms = [&](double m) { return 0.1 * m * std::log(cs.yarn.factor) + 1.0; };
                mag = ms(cs.yarn.mscale) / ms(cs.yarn.mscale_all_dim);
            }
            // softmax scale: tau times yarn_mscale(factor, mscale_all_dim)^2 (1 when mscale_all_dim is 0)
            const double all_dim = cs.yarn.yarn && cs.yarn.mscale_all_dim != 0 ? 0.1 * cs.yarn.mscale_all_dim * std::log(cs.yarn.factor) + 1 : 1;
            const bool scale_ok = softmax_scale(cfg) == static_cast<float>(all_dim * all_dim / std::sqrt(d_n + d_r));
            double table_err = std::abs(table.magnitude - mag) / mag;
            for (int i = 0; i < d_r / 2; ++i) table_err = std::max(table_err, std::abs(table.inv_freq[i] - freq[i]) / freq[i]);
            // positions inside and past the original context, up to k2mini's last cache row
            const std::vector<int32_t> pos = {0, 7, 250, 511, 512, 1087, 4095};
            const std::vector<float> x = rng.vec(static_cast<size_t>(M) * rs);
            std::vector<double> ref(x.begin(), x.end());
            for (int m = 0; m < M; ++m)
                for (int h = 0; h < H; ++h)
                    for (int i = 0; i < d_r / 2; ++i) {
                        const double ang = pos[m] * freq[i];
                        const size_t o = static_cast<size_t>(m) * rs + h * vs + d_n + 2 * i;
                        ref[o] = mag * (x[o] * std::cos(ang) - x[o + 1] * std::sin(ang));
                        ref[o + 1] = mag * (x[o] * std::sin(ang) + x[o + 1] * std::cos(ang));
                    }
            float* xb = buf.put(x);
            be.rope(xb, M, rs, H, vs, d_n, d_r, pos.data(), table);
            const double e = nmse(buf.get(xb, x.size()), ref);
            report(p + cs.name, e < 1e-7 && table_err < 1e-14 && scale_ok,
                   "nmse=" + fmt("%.2e", e) + " table rel err=" + fmt("%.1e", table_err) +
                       (scale_ok ? " softmax scale ok" : " SOFTMAX SCALE WRONG"));
        }
    }
    {  // silu_mul and add, in place
        const size_t n = 1000;
        const std::vector<float> a = rng.vec(n, 6.0f), b = rng.vec(n, 2.0f);
        std::vector<double> rs(n), ra(n);
        for (size_t i = 0; i < n; ++i) {
            rs[i] = a[i] / (1.0 + std::exp(-static_cast<double>(a[i]))) * b[i];
            ra[i] = static_cast<double>(a[i]) + b[i];
        }
        float* ab = buf.put(a);
        float* bb = buf.put(b);
        float* sum = buf.zeros<float>(n);
        be.add(sum, ab, bb, n);
        be.silu_mul(ab, ab, bb, n);
        const double es = nmse(buf.get(ab, n), rs), ea = nmse(buf.get(sum, n), ra);
        report(p + "silu_mul", es < 1e-7, "nmse=" + fmt("%.2e", es));
        report(p + "add", ea < 1e-7, "nmse=" + fmt("%.2e", ea));
    }
}

// Row m of a batched call must equal the same row computed alone, bit for bit.
bool rows_match_single(const std::vector<float>& batched, const std::function<std::vector<float>(int)>& single, int M,
                       size_t row) {
    for (int m = 0; m < M; ++m) {
        const std::vector<float> one = single(m);
        if (std::memcmp(one.data(), batched.data() + m * row, row * sizeof(float)) != 0) return false;
    }
    return true;
}

void test_matmuls(Backend& be, const std::string& p) {
    Rng rng(2);
    Buffers buf(be);
    // {3, 700, 1024} is large enough for the CPU backend to split it over threads; {2, 1100, 4096}
    // wide and large enough for the CUDA backend's matmul_f32 to take cuBLAS where it has it,
    // {2, 1100, 160} wide but small (the drafter's case: the CUDA kernel); {3, 100, 4096}
    // long enough (4 warp steps) for the CUDA kernel's three-buffer loop at one row; {2, 384, 7168}
    // (the K2 router) and {2, 80, 4800} (a short last super-chunk, a partial warp step) put the
    // single rows on the CUDA backend's narrow one-row kernel and the pair on mm_kernel's split-K.
    // The last four reach the INT4 kernel's 16- and 32-row passes: full steps at 4 and 8 token
    // quads (K a multiple of 256), a short last super-chunk, and more rows than one launch takes.
    const int shapes[][3] = {{1, 72, 160}, {5, 72, 160}, {17, 72, 160}, {3, 700, 1024}, {2, 1100, 160}, {2, 1100, 4096},
                             {3, 100, 4096}, {2, 384, 7168}, {2, 80, 4800}, {13, 300, 1280}, {20, 100, 2048},
                             {40, 72, 1280}, {33, 100, 800}};
    for (const auto& shape : shapes) {
        const int M = shape[0], N = shape[1], K = shape[2];
        const std::vector<float> x = rng.vec(static_cast<size_t>(M) * K), W = rng.vec(static_cast<size_t>(N) * K, 0.1f),
                                 bias = rng.vec(N);
        float* xb = buf.put(x);
        float* Wb = buf.put(W);
        float* biasb = buf.put(bias);
        float* y = buf.zeros<float>(static_cast<size_t>(M) * N);
        be.matmul_f32(y, xb, Wb, biasb, M, N, K);
        const std::vector<float> got = buf.get(y, static_cast<size_t>(M) * N);
        const double e = nmse(got, ref_matmul(x, W, &bias, M, N, K));
        const bool rows = rows_match_single(got, [&](int m) {
            float* y1 = buf.zeros<float>(N);
            be.matmul_f32(y1, xb + static_cast<size_t>(m) * K, Wb, biasb, 1, N, K);
            return buf.get(y1, N);
        }, M, N);
        report(p + "matmul_f32.M" + std::to_string(M) + (N > 72 ? "_N" + std::to_string(N) + "_K" + std::to_string(K) : ""), e < 5e-4 && rows, "nmse=" + fmt("%.2e", e) + (rows ? " rows independent of M" : " ROW DEPENDS ON M"));

        const Quantized q = random_int4(rng, N, K);
        const auto [qb, sb] = buf.put_w4a16(q.qw, q.sc, N, K);
        be.matmul_w4a16(y, xb, qb, sb, M, N, K);
        const std::vector<float> g4 = buf.get(y, static_cast<size_t>(M) * N);
        const double e4 = nmse(g4, ref_matmul(x, q.dequant, nullptr, M, N, K));
        const bool rows4 = rows_match_single(g4, [&](int m) {
            float* y1 = buf.zeros<float>(N);
            be.matmul_w4a16(y1, xb + static_cast<size_t>(m) * K, qb, sb, 1, N, K);
            return buf.get(y1, N);
        }, M, N);
        report(p + "matmul_w4a16.M" + std::to_string(M) + (N > 72 ? "_N" + std::to_string(N) + "_K" + std::to_string(K) : ""), e4 < 5e-4 && rows4, "nmse=" + fmt("%.2e", e4) + (rows4 ? " rows independent of M" : " ROW DEPENDS ON M"));
    }
    {  // nibble order: one non-zero nibble at input k must pick x[k] alone
        const int N = 8, K = 64;
        std::vector<int32_t> qw(static_cast<size_t>(N) * K / 8, static_cast<int32_t>(0x88888888u));
        std::vector<float> sc(static_cast<size_t>(N) * K / 32, 1.0f), x(K);
        std::iota(x.begin(), x.end(), 1.0f);
        const int ks[N] = {0, 1, 7, 8, 15, 31, 32, 63};
        for (int n = 0; n < N; ++n) {
            uint32_t& w = reinterpret_cast<uint32_t&>(qw[n * K / 8 + ks[n] / 8]);
            w = (w & ~(15u << (4 * (ks[n] % 8)))) | (9u << (4 * (ks[n] % 8)));  // nibble 9 = +1 * scale
        }
        float* y = buf.zeros<float>(N);
        const auto [qb, sb] = buf.put_w4a16(qw, sc, N, K);
        be.matmul_w4a16(y, buf.put(x), qb, sb, 1, N, K);
        const std::vector<float> got = buf.get(y, N);
        bool ok = true;
        for (int n = 0; n < N; ++n) ok = ok && got[n] == x[ks[n]];
        report(p + "matmul_w4a16.nibble_order", ok, "word j nibble k (bits 4k..4k+3) is input 8j+k");
    }
}

// mla_attention on a random tree of M rows after `committed` cache rows: NMSE against the double
// reference, and each tree row bit-equal to the same row decoded alone after its ancestors were
// compacted into a chain (the DDTree == AR invariant at op level).
void attention_case(Backend& be, Rng& rng, const std::string& name, const MlaDims& d, int committed, int M) {
    Buffers buf(be);
    const int W = d.d_c + d.d_r, qs = d.n_heads * (d.d_n + d.d_r);
    const std::vector<int32_t> parent = random_tree(rng, M);
    const std::vector<float> cache = rng.vec(static_cast<size_t>(committed + M + 4) * W),
                             q = rng.vec(static_cast<size_t>(M) * qs),
                             wkv_b = rng.vec(static_cast<size_t>(d.n_heads) * (d.d_n + d.d_v) * d.d_c, 0.2f);
    float* cb = buf.put(cache);
    float* qb = buf.put(q);
    float* wb = buf.put(wkv_b);
    float* out = buf.zeros<float>(static_cast<size_t>(M) * d.n_heads * d.d_v);
    Visibility vis;
    vis.committed = committed;
    vis.parent_host = parent.data();
    vis.capacity = committed + M + 4;  // the rows of `cache` (the single-row calls below leave it unknown)
    be.mla_attention(out, qb, wb, cb, vis, M, d);
    const std::vector<float> got = buf.get(out, static_cast<size_t>(M) * d.n_heads * d.d_v);
    const double e = nmse(got, ref_attention(q, wkv_b, cache, committed, parent, d));
    report(name, e < 5e-4, "nmse=" + fmt("%.2e", e) + " (ancestor-only mask, " + std::to_string(M) + " rows after " +
                               std::to_string(committed) + ")");

    bool exact = true;
    const size_t row = static_cast<size_t>(d.n_heads) * d.d_v;
    for (int m = 0; m < M; ++m) {
        const std::vector<int> chain = ancestors_and_self(parent, m);
        std::vector<float> compacted(cache.begin(), cache.begin() + static_cast<long>(committed) * W);
        for (int a : chain)
            compacted.insert(compacted.end(), cache.begin() + static_cast<long>(committed + a) * W,
                             cache.begin() + static_cast<long>(committed + a + 1) * W);
        const int32_t none = -1;
        Visibility alone;
        alone.committed = committed + static_cast<int>(chain.size()) - 1;
        alone.parent_host = &none;
        float* o1 = buf.zeros<float>(row);
        be.mla_attention(o1, qb + static_cast<size_t>(m) * qs, wb, buf.put(compacted), alone, 1, d);
        exact = exact && std::memcmp(buf.get(o1, row).data(), got.data() + m * row, row * sizeof(float)) == 0;
    }
    report(name + "_row_equals_chain", exact, "tree rows bit-equal to single-row decode over the compacted chain");
}

void test_attention(Backend& be, const std::string& p) {
    Rng rng(3);
    Buffers buf(be);
    MlaDims d;
    d.n_heads = 3; d.d_c = 32; d.d_n = 16; d.d_r = 8; d.d_v = 16;
    d.scale = 1.0f / std::sqrt(24.0f);
    attention_case(be, rng, p + "mla_attention.tree", d, 11, 9);
    // k2mini's heads at its full context: 4090 committed rows, YaRN's softmax scale (x 1.874)
    MlaDims k2;
    k2.n_heads = 4; k2.d_c = 64; k2.d_n = 32; k2.d_r = 32; k2.d_v = 32;
    k2.scale = static_cast<float>(std::pow(0.1 * std::log(40.0) + 1, 2) / 8.0);
    attention_case(be, rng, p + "mla_attention.long_context", k2, 4090, 6);

    const int W = d.d_c + d.d_r;
    const std::vector<float> cache = rng.vec(static_cast<size_t>(24) * W);
    // kv_compact equals a gather of the accepted rows in every layer; the rows before the
    // committed length and past the path stay as they were.
    const int layers = 2, rows_per_layer = 24, start = 5;
    const long stride = static_cast<long>(rows_per_layer) * W;
    const std::vector<float> caches = rng.vec(static_cast<size_t>(layers) * stride);
    const std::vector<int32_t> keep = {0, 2, 3, 7};
    std::vector<int32_t> accepted(AcceptedPath::size(9), -1);
    accepted[AcceptedPath::kCount] = static_cast<int32_t>(keep.size());
    std::copy(keep.begin(), keep.end(), accepted.begin() + AcceptedPath::kPath);
    float* c2 = buf.put(caches);
    Visibility verified;
    verified.committed = start;
    be.kv_compact(c2, stride, layers, W, verified, buf.put(accepted));
    const std::vector<float> after = buf.get(c2, caches.size());
    bool gathered = true;
    for (int l = 0; l < layers; ++l) {
        const auto row = [&](const std::vector<float>& c, long r) { return c.begin() + l * stride + r * W; };
        for (long r = 0; r < rows_per_layer; ++r) {
            const long j = r - start;
            const long from = j >= 0 && j < static_cast<long>(keep.size()) ? start + keep[j] : r;
            gathered = gathered && std::equal(row(after, r), row(after, r) + W, row(caches, from));
        }
    }
    report(p + "kv_compact", gathered, "equals a gather of the accepted rows in every layer");

    // gather_rows with device indices, into a strided destination.
    const std::vector<int32_t> index = {3, 0, 3};
    float* g = buf.zeros<float>(static_cast<size_t>(3) * (W + 2));
    be.gather_rows(g, W + 2, buf.put(caches), W, buf.put(index), 3);
    const std::vector<float> got = buf.get(g, static_cast<size_t>(3) * (W + 2));
    bool rows_ok = true;
    for (int i = 0; i < 3; ++i)
        rows_ok = rows_ok && std::equal(got.begin() + i * (W + 2), got.begin() + i * (W + 2) + W, caches.begin() + index[i] * W) &&
                  got[i * (W + 2) + W] == 0.0f && got[i * (W + 2) + W + 1] == 0.0f;
    report(p + "gather_rows", rows_ok, "rows by device index, the stride's gap untouched");

    // kv_append writes the rows at the committed length and nothing else.
    const std::vector<float> rows = rng.vec(static_cast<size_t>(3) * W);
    float* c3 = buf.put(cache);
    Visibility at;
    at.committed = 7;
    be.kv_append(c3, W, at, buf.put(rows), 3);
    std::vector<float> want = cache;
    std::copy(rows.begin(), rows.end(), want.begin() + static_cast<long>(7) * W);
    report(p + "kv_append", buf.get(c3, cache.size()) == want, "rows written at the committed length, the rest unchanged");
}

void test_moe(Backend& be, const std::string& p) {
    Rng rng(4);
    Buffers buf(be);
    // {experts, top_k, groups, groups kept, rows}: tiny2-like, and k2mini's (DeepSeek-V3's routing
    // at 64 experts: 8 groups, 4 kept, top-8) over more rows than one warp.
    const int gate_cases[][5] = {{16, 3, 1, 1, 7}, {16, 3, 4, 2, 7}, {64, 8, 8, 4, 37}};
    for (const auto& gc : gate_cases) {
        const int groups = gc[2];
        MoeRouting r;
        r.n_experts = gc[0]; r.top_k = gc[1]; r.n_groups = groups; r.topk_groups = gc[3]; r.route_scale = 2.5f;
        const int M = gc[4], E = r.n_experts, gs = E / groups;
        const std::vector<float> logits = rng.vec(static_cast<size_t>(M) * E, 3.0f), bias = rng.vec(E, 0.3f);
        int32_t* idx = buf.zeros<int32_t>(static_cast<size_t>(M) * r.top_k);
        float* wt = buf.zeros<float>(static_cast<size_t>(M) * r.top_k);
        be.moe_gate(idx, wt, buf.put(logits), buf.put(bias), M, r);
        const std::vector<int32_t> gi = buf.get(idx, static_cast<size_t>(M) * r.top_k);
        const std::vector<float> gw = buf.get(wt, static_cast<size_t>(M) * r.top_k);
        std::vector<double> ref_w;
        bool same_idx = true;
        for (int m = 0; m < M; ++m) {
            std::vector<double> s(E), sel(E);
            for (int e = 0; e < E; ++e) {
                s[e] = 1.0 / (1.0 + std::exp(-static_cast<double>(logits[m * E + e])));
                sel[e] = s[e] + bias[e];
            }
            std::vector<int> order(E);
            const auto by_sel = [&](const std::vector<double>& v) {
                return [&v](int a, int b) { return v[a] > v[b] || (v[a] == v[b] && a < b); };
            };
            if (groups > 1) {
                std::vector<double> gsc(groups);
                for (int g = 0; g < groups; ++g) {
                    std::vector<double> in(sel.begin() + g * gs, sel.begin() + (g + 1) * gs);
                    std::sort(in.rbegin(), in.rend());
                    gsc[g] = in[0] + in[1];
                }
                std::vector<int> go(groups);
                std::iota(go.begin(), go.end(), 0);
                std::sort(go.begin(), go.end(), by_sel(gsc));
                for (int e = 0; e < E; ++e)
                    if (std::find(go.begin(), go.begin() + r.topk_groups, e / gs) == go.begin() + r.topk_groups) sel[e] = -1e300;
            }
            std::iota(order.begin(), order.end(), 0);
            std::sort(order.begin(), order.end(), by_sel(sel));
            double total = 0;
            for (int j = 0; j < r.top_k; ++j) total += s[order[j]];
            for (int j = 0; j < r.top_k; ++j) {
                same_idx = same_idx && gi[m * r.top_k + j] == order[j];
                ref_w.push_back(s[order[j]] / total * r.route_scale);
            }
        }
        const double e = nmse(gw, ref_w);
        const std::string gate_name = E == 16 ? "moe_gate.groups" + std::to_string(groups)
                                              : "moe_gate.E" + std::to_string(E) + "_groups" + std::to_string(groups) + "_keep" +
                                                    std::to_string(r.topk_groups) + "_top" + std::to_string(r.top_k);
        report(p + gate_name, same_idx && e < 1e-7, std::string(same_idx ? "same experts" : "DIFFERENT EXPERTS") + " weights nmse=" + fmt("%.2e", e));
    }
    // {M, E, skewed, shared}: skewed routes rows 0..9 to expert 0 first (more rows than one pass
    // of the CUDA INT4 kernel at this mean load), and M = 19 takes two passes of the layer on
    // CUDA; shared stacks a shared expert after the E routed ones (ExpertWeights::shared), which
    // the CUDA backend runs as one more slot of its grouped launches at any row count when it is
    // this small (16 rows of it in passes of 4 there).
    const int configs[][4] = {{6, 5, 0, 0}, {19, 24, 1, 0}, {19, 24, 1, 1}};
    for (const auto& cfg : configs)
    for (const bool int4 : {false, true}) {
        const int M = cfg[0], E = cfg[1], D = 64, I = 96, k = 2;
        const bool skewed = cfg[2] != 0, shared = cfg[3] != 0;
        const int n_sets = E + (shared ? 1 : 0);
        ExpertWeights w;
        w.n_experts = E; w.dim = D; w.inter = I; w.int4 = int4; w.shared = shared;
        std::vector<float> deq[3];
        for (int j = 0; j < 3; ++j) {
            const int out = j == 1 ? D : I, in = j == 1 ? I : D;
            Quantized q;
            if (int4) {
                for (int e = 0; e < n_sets; ++e) {
                    const Quantized qe = random_int4(rng, out, in);
                    q.qw.insert(q.qw.end(), qe.qw.begin(), qe.qw.end());
                    q.sc.insert(q.sc.end(), qe.sc.begin(), qe.sc.end());
                    q.dequant.insert(q.dequant.end(), qe.dequant.begin(), qe.dequant.end());
                }
                const auto [qb, sb] = buf.put_w4a16(q.qw, q.sc, out, in, n_sets);
                (j == 0 ? w.q1 : j == 1 ? w.q2 : w.q3) = qb;
                (j == 0 ? w.s1 : j == 1 ? w.s2 : w.s3) = sb;
            } else {
                q.dequant = rng.vec(static_cast<size_t>(n_sets) * out * in, 0.15f);
                (j == 0 ? w.w1 : j == 1 ? w.w2 : w.w3) = buf.put(q.dequant);
            }
            deq[j] = q.dequant;
        }
        const std::vector<float> x = rng.vec(static_cast<size_t>(M) * D);
        std::vector<int32_t> idx(static_cast<size_t>(M) * k);
        std::vector<float> wt = rng.vec(static_cast<size_t>(M) * k);
        for (int m = 0; m < M; ++m) {
            idx[m * k] = skewed && m < 10 ? 0 : rng.below(E);
            idx[m * k + 1] = (idx[m * k] + 1 + rng.below(E - 1)) % E;
        }
        std::vector<double> ref(static_cast<size_t>(M) * D, 0.0);
        for (int m = 0; m < M; ++m)
            for (int j = 0; j < k + (shared ? 1 : 0); ++j) {  // j = k: the shared expert, weight 1
                const size_t e = static_cast<size_t>(j < k ? idx[m * k + j] : E), per = static_cast<size_t>(I) * D;
                std::vector<double> h(I);
                for (int i = 0; i < I; ++i) {
                    double a = 0, b = 0;
                    for (int c = 0; c < D; ++c) {
                        a += static_cast<double>(deq[0][e * per + i * D + c]) * x[m * D + c];
                        b += static_cast<double>(deq[2][e * per + i * D + c]) * x[m * D + c];
                    }
                    h[i] = a / (1.0 + std::exp(-a)) * b;
                }
                for (int c = 0; c < D; ++c) {
                    double y = 0;
                    for (int i = 0; i < I; ++i) y += deq[1][e * per + c * I + i] * h[i];
                    ref[m * D + c] += (j < k ? wt[m * k + j] : 1.0) * y;
                }
            }
        float* xb = buf.put(x);
        int32_t* ib = buf.put(idx);
        float* wb = buf.put(wt);
        float* out = buf.zeros<float>(static_cast<size_t>(M) * D);
        be.moe_ffn(out, xb, ib, wb, M, k, w);
        const std::vector<float> got = buf.get(out, static_cast<size_t>(M) * D);
        const double e = nmse(got, ref);
        const bool rows = rows_match_single(got, [&](int m) {
            float* o1 = buf.zeros<float>(D);
            be.moe_ffn(o1, xb + m * D, ib + m * k, wb + m * k, 1, k, w);
            return buf.get(o1, D);
        }, M, D);
        report(p + (int4 ? "moe_ffn.int4" : "moe_ffn.fp32") + (skewed ? ".M19_skewed" : "") + (shared ? "_shared" : ""), e < 5e-4 && rows, "nmse=" + fmt("%.2e", e) + (rows ? " rows independent of M" : " ROW DEPENDS ON M"));
        // moe_gate_ffn against moe_gate then moe_ffn, bit for bit (idx, weight, out), at one row
        // (where the CUDA gate's kernel writes moe_ffn's routing lists itself) and at M rows.
        MoeRouting r;
        r.n_experts = E; r.top_k = k; r.route_scale = 1.7f;
        const float* logits = buf.put(rng.vec(static_cast<size_t>(M) * E, 3.0f));
        const float* bias = buf.put(rng.vec(E, 0.3f));
        bool same = true;
        for (const int rows_in : {1, M}) {
            const size_t nk = static_cast<size_t>(rows_in) * k, nd = static_cast<size_t>(rows_in) * D;
            int32_t* ia = buf.zeros<int32_t>(nk);
            int32_t* ic = buf.zeros<int32_t>(nk);
            float* wa = buf.zeros<float>(nk);
            float* wc = buf.zeros<float>(nk);
            float* oa = buf.zeros<float>(nd);
            float* oc = buf.zeros<float>(nd);
            be.moe_gate(ia, wa, logits, bias, rows_in, r);
            be.moe_ffn(oa, xb, ia, wa, rows_in, k, w);
            be.moe_gate_ffn(oc, xb, ic, wc, logits, bias, rows_in, r, w);
            same = same && buf.get(ia, nk) == buf.get(ic, nk) &&
                   std::memcmp(buf.get(wa, nk).data(), buf.get(wc, nk).data(), nk * sizeof(float)) == 0 &&
                   std::memcmp(buf.get(oa, nd).data(), buf.get(oc, nd).data(), nd * sizeof(float)) == 0;
        }
        report(p + (int4 ? "moe_gate_ffn.int4" : "moe_gate_ffn.fp32") + ".E" + std::to_string(E) + (shared ? "_shared" : ""), same,
               same ? "= moe_gate + moe_ffn bit for bit at 1 and " + std::to_string(M) + " rows" : "DIFFERS from moe_gate + moe_ffn");
    }
}

void test_sampling(Backend& be, const std::string& p) {
    Rng rng(5);
    Buffers buf(be);
    const int M = 4, N = 300, K = 10;
    std::vector<float> x = rng.vec(static_cast<size_t>(M) * N, 4.0f);
    x[1 * N + 17] = x[1 * N + 250] = 9.0f;  // a tie: the lower index wins
    float* xb = buf.put(x);
    std::vector<int32_t> am(M);
    be.argmax(am.data(), xb, M, N);
    bool ok = am[1] == 17;
    for (int m = 0; m < M; ++m) ok = ok && am[m] == std::max_element(x.begin() + m * N, x.begin() + (m + 1) * N) - (x.begin() + m * N);
    report(p + "argmax", ok, "ties go to the lower index");

    int32_t* tok_b = buf.zeros<int32_t>(static_cast<size_t>(M) * K);
    float* lp_b = buf.zeros<float>(static_cast<size_t>(M) * K);
    be.log_softmax_topk(tok_b, lp_b, xb, M, N, K);
    const std::vector<int32_t> tok = buf.get(tok_b, static_cast<size_t>(M) * K);
    const std::vector<float> lp = buf.get(lp_b, static_cast<size_t>(M) * K);
    std::vector<double> ref;
    bool same = true;
    for (int m = 0; m < M; ++m) {
        double mx = -1e300, total = 0;
        for (int j = 0; j < N; ++j) mx = std::max(mx, static_cast<double>(x[m * N + j]));
        for (int j = 0; j < N; ++j) total += std::exp(x[m * N + j] - mx);
        std::vector<int> order(N);
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return x[m * N + a] > x[m * N + b]; });
        for (int k = 0; k < K; ++k) {
            same = same && tok[m * K + k] == order[k];
            ref.push_back(x[m * N + order[k]] - mx - std::log(total));
        }
    }
    const double e = nmse(lp, ref);
    report(p + "log_softmax_topk", same && e < 1e-7, std::string(same ? "same tokens" : "DIFFERENT TOKENS") + " nmse=" + fmt("%.2e", e));

    // tree_accept: post is each node's argmax; the walk follows post through matching children
    // (node 4 carries post[1] too but is no child of node 1), against the host walk and by hand.
    const std::vector<int32_t> tokens = {5, 10, 11, 20, 21, 30, 21};
    const std::vector<int32_t> parents = {-1, 0, 0, 1, 2, 4, 1};
    const int T = static_cast<int>(tokens.size()), V = 40;
    for (const auto& [post, want] : std::vector<std::pair<std::vector<int32_t>, std::vector<int32_t>>>{
             {{11, 0, 21, 0, 30, 7, 0}, {0, 2, 4, 5}}, {{12, 0, 0, 0, 0, 0, 0}, {0}}, {{10, 21, 0, 0, 0, 0, 0}, {0, 1, 6}}}) {
        std::vector<float> logits = rng.vec(static_cast<size_t>(T) * V);
        for (int i = 0; i < T; ++i) logits[static_cast<size_t>(i) * V + post[i]] = 5.0f;
        int32_t* acc = buf.zeros<int32_t>(AcceptedPath::size(T));
        be.tree_accept(acc, buf.put(logits), V, tokens.data(), parents.data(), T);
        const std::vector<int32_t> a = buf.get(acc, AcceptedPath::size(T));
        const int n = a[AcceptedPath::kCount];
        const std::vector<int32_t> path(a.begin() + AcceptedPath::kPath, a.begin() + AcceptedPath::kPath + std::clamp(n, 0, T));
        const bool ok = path == want && path == accept_path(tokens.data(), parents.data(), T, post.data()) &&
                        a[AcceptedPath::kLast] == want.back() && a[AcceptedPath::kBonus] == post[want.back()] &&
                        std::equal(post.begin(), post.end(), a.begin() + AcceptedPath::post(T));
        report(p + "tree_accept.path" + std::to_string(want.size()), ok, "post, path, last node and bonus as the host walk");
    }
}

// ---- host-side DDTree -------------------------------------------------------------------

void test_tree() {
    Rng rng(6);
    const int L = 4, K = 5;
    for (const int B : {1, 7, 30, 100}) {
        const int k = std::min(B, K);
        std::vector<int32_t> tokens(static_cast<size_t>(L) * k);
        std::vector<float> lq(static_cast<size_t>(L) * k);
        for (int d = 0; d < L; ++d) {
            std::vector<float> v = rng.vec(k, 3.0f);
            std::sort(v.rbegin(), v.rend());
            if (d == 1 && k > 2) v[2] = v[1];  // a tie inside a depth
            for (int r = 0; r < k; ++r) { lq[d * k + r] = v[r] - 4.0f; tokens[d * k + r] = 100 * d + r; }
        }
        const DraftTree t = build_tree(999, tokens, lq, L, k, B);
        // Brute force: every rank tuple, scored as the heap scores it, sorted best first.
        std::vector<std::pair<double, std::vector<int32_t>>> all;
        std::function<void(std::vector<int32_t>&, double)> walk = [&](std::vector<int32_t>& ranks, double score) {
            if (!ranks.empty()) all.emplace_back(score, ranks);
            if (static_cast<int>(ranks.size()) == L) return;
            for (int r = 0; r < k; ++r) {
                ranks.push_back(r);
                walk(ranks, score + lq[(ranks.size() - 1) * k + r]);
                ranks.pop_back();
            }
        };
        std::vector<int32_t> empty;
        walk(empty, 0.0);
        std::sort(all.begin(), all.end(), [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); });
        bool ok = static_cast<int>(t.tokens.size()) == 1 + std::min<int>(B, static_cast<int>(all.size())) && t.parents[0] == -1;
        std::map<std::vector<int32_t>, int> index{{{}, 0}};
        for (size_t i = 1; ok && i < t.tokens.size(); ++i) {
            const std::vector<int32_t>& ranks = all[i - 1].second;
            index[ranks] = static_cast<int>(i);
            const std::vector<int32_t> up(ranks.begin(), ranks.end() - 1);
            ok = t.depths[i] == static_cast<int>(ranks.size()) && t.tokens[i] == tokens[(ranks.size() - 1) * k + ranks.back()] &&
                 index.count(up) && t.parents[i] == index[up] && t.parents[i] < static_cast<int>(i);
        }
        report("tree.heap_equals_brute_force.B" + std::to_string(B), ok, "top-B prefixes in score order, ties by rank tuple");
    }
}

// ---- SHA-256 (the bundle hashes) ---------------------------------------------------------------

// FIPS 180-4's examples (NIST CSRC, SHA256.pdf and SHA2_Additional.pdf) and the same messages fed
// in uneven pieces.
void test_sha256() {
    const std::string a448 = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
    const std::string a896 = "abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrlmnopqrsmnopqrstnopqrstu";
    const std::pair<std::string, const char*> vectors[] = {
        {"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"},
        {"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"},
        {a448, "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"},
        {a896, "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1"},
        {std::string(1000000, 'a'), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"},
        // the padding's edges: 55 bytes pad within one block, 56 need a second, 64 fill one (Python's hashlib)
        {std::string(55, 'x'), "d5e285683cd4efc02d021a5c62014694958901005d6f71e89e0989fac77e4072"},
        {std::string(56, 'x'), "04c26261370ee7541549d16dee320c723e3fd14671e66a099afe0a377c16888e"},
        {std::string(64, 'x'), "7ce100971f64e7001e8fe5a51973ecdfe1ced42befe7ee8d5fd6219506b5393c"},
    };
    bool ok = true;
    std::string detail = std::string("NIST vectors ('', abc, 448 and 896 bits, a million 'a') and padding edges, whole and in pieces, ") +
                         (sha256_accelerated() ? "SHA extensions and portable rounds" : "portable rounds (no SHA extensions here)");
    for (const auto& v : vectors) {
        for (const bool portable : {false, true}) {
            Sha256 whole(portable), pieces(portable);
            whole.update(v.first.data(), v.first.size());
            for (size_t at = 0, step = 1; at < v.first.size(); at += step, step = step * 3 % 257 + 1)
                pieces.update(v.first.data() + at, std::min(step, v.first.size() - at));
            const std::string one = hex(whole.digest()), piecewise = hex(pieces.digest());
            if (one != v.second || piecewise != v.second) {
                ok = false;
                detail = std::string(portable ? "portable" : "default") + " rounds, message of " + std::to_string(v.first.size()) +
                         " bytes: " + one + " / " + piecewise;
            }
        }
    }
    report("sha256.fips_180_4", ok, detail);
}

// The message of what f throws ("" when it returns).
std::string thrown(const std::function<void()>& f) {
    try {
        f();
    } catch (const std::exception& e) {
        return e.what();
    }
    return "";
}

// InputFile::read_all in small chunks (many per thread): the bytes as written; a file that
// shrinks after opening refused at the offset where it ends; one that grows refused by its sizes.
void test_file_read() {
    const char* dir = std::getenv("TMPDIR");
    std::string path = std::string(dir && *dir ? dir : "/tmp") + "/test_ops.file_read.XXXXXX";
    const int fd = mkstemp(&path[0]);
    if (fd < 0) return report("file_read.setup", false, "mkstemp " + path + " failed");
    std::vector<uint8_t> want(1000003);
    Rng rng(7);
    for (uint8_t& x : want) x = static_cast<uint8_t>(rng.next());
    const bool written = write(fd, want.data(), want.size()) == static_cast<ssize_t>(want.size());
    const uint64_t chunk = 65537;  // 16 chunks, the last one short
    size_t threads = 0;
    FileBytes got;
    std::string error = written ? thrown([&] { got = InputFile(path).read_all(&threads, chunk); }) : "write failed";
    report("file_read.chunks", error.empty() && std::equal(got.begin(), got.end(), want.begin(), want.end()),
           error.empty() ? std::to_string(got.size()) + " bytes in chunks of " + std::to_string(chunk) + " on " + std::to_string(threads) + " threads"
                         : error);
    error = thrown([&] {
        const InputFile in(path);
        if (ftruncate(fd, 300000) != 0) throw std::runtime_error("ftruncate failed");
        in.read_all(nullptr, chunk);
    });
    const std::string shrunk = "short read at offset 300000: the file ends there, it had 1000003 bytes when opened";
    report("file_read.shrunk_while_read", error.rfind(shrunk, 0) == 0, "got '" + error + "'");
    error = thrown([&] {
        const InputFile in(path);
        if (pwrite(fd, want.data(), 10, 300000) != 10) throw std::runtime_error("pwrite failed");
        in.read_all(nullptr, chunk);
    });
    report("file_read.grew_while_read", error == "the file changed size while read: 300000 bytes when opened, 300010 after the read",
           "got '" + error + "'");
    close(fd);
    unlink(path.c_str());
}

}  // namespace

int main(int argc, char** argv) {
    std::string which = "all";
    for (int i = 1; i < argc; ++i) {
        if (std::string(argv[i]) == "--backend" && i + 1 < argc) which = argv[++i];
        else { std::fprintf(stderr, "usage: test_ops [--backend cpu|cuda|all]\n"); return 2; }
    }
    std::vector<std::string> names;
    if (which == "all") {
        const std::string avail = available_backends();
        for (size_t s = 0, c; s <= avail.size(); s = c + 1) {
            c = avail.find(',', s);
            if (c == std::string::npos) c = avail.size();
            names.push_back(avail.substr(s, c - s));
        }
    } else {
        names.push_back(which);
    }
    test_tree();
    test_sha256();
    test_file_read();
    for (const std::string& name : names) {
        std::unique_ptr<Backend> be;
        try {
            be = make_backend(name);
        } catch (const std::exception& e) {
            std::printf("skip %s.* %s\n", name.c_str(), e.what());
            continue;
        }
        const std::string p = name + ".";
        const std::function<void(Backend&, const std::string&)> groups[] = {test_elementwise, test_matmuls, test_attention,
                                                                             test_moe, test_sampling};
        for (const auto& group : groups) {
            try {
                group(*be, p);
            } catch (const std::exception& e) {
                report(p + "exception", false, e.what());
            }
        }
    }
    std::printf("%s\n", g_failed ? (std::to_string(g_failed) + " op tests failed").c_str() : "all op tests passed");
    return g_failed ? 1 : 0;
}
