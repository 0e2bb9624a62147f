// bench_gpu.cu: GPU benchmarks of the CUDA backend's kernels (llm.c dev/cuda style: reference,
// kernel versions, validation, bandwidth printout), all figures from one run on one device.
//
//   1. ceiling: a 128-bit read-only kernel over 4 GiB (and a device-to-device copy for scale).
//   2. w4a16 GEMV/GEMM at M = 1, 2, 4, 8, 16 on 2048x7168, 7168x2048, 28672x8192 (N x K):
//      v1 = one warp per row, 32-bit loads, global activations (the straightforward kernel);
//      v2 = the backend's kernel (matmul_w4a16, w4a16_core.cuh); validated against a double-precision
//      CPU reference on sampled rows; side by side with cuBLAS SGEMM on the fp32 weights and
//      cuBLAS bf16 (cublasGemmEx, fp32 accumulate) on bf16 weights. Weight copies rotate so that
//      no call reads from L2 what the previous call left there.
//   3. one Kimi-K2-shaped MoE layer (h 7168, 384 experts, top-8, moe_inter 2048, 1 shared expert)
//      with random weights made on the device, for 1..16 tokens: INT4 (backend ops: a CUDA graph
//      per layer, 8 layers in one graph, and eager) against FP32 through cuBLAS (routing read
//      back, 3 SGEMMs per selected expert, no TF32) and FP32 through our grouped kernel; outputs
//      compared; the INT4 output's bits as a hash (two builds of the layer compare by it).
//
//   bench_gpu [--json PATH] [--quick] [--only N K M] [--only-f32 N K M] [--moe T] [--moe-int4 T] [--moe-only] [--moe-probe]
//   (--only: time one matmul_w4a16 shape; --only-f32: one matmul_f32 shape, cuBLAS and our kernel;
//   --moe: run the MoE layer's paths once at T tokens, for ncu; --moe-int4: its INT4 paths only,
//   without the FP32 experts' 68 GB, for ncu's sections that replay a launch; --moe-only: the ceiling and the
//   MoE rows, no GEMM table; --moe-probe: at 1 and 4 tokens, the layer timed in more ways, printed)
#include "../src/cuda/ops.cuh"
#include "../src/cuda/w4a16_core.cuh"

#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <tuple>
#include <sstream>
#include <string>
#include <vector>

using namespace kd;
using namespace kd::cuda;

namespace {

#define CUBLAS_CHECK(call)                                                                              \
    do {                                                                                                \
        const cublasStatus_t st_ = (call);                                                              \
        if (st_ != CUBLAS_STATUS_SUCCESS)                                                               \
            throw std::runtime_error(std::string(#call) + " failed: status " + std::to_string(st_));    \
    } while (0)

// ---- device data --------------------------------------------------------------------------

__device__ __forceinline__ uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
__device__ __forceinline__ float hash_uniform(uint64_t seed, uint64_t i, float lo, float hi) {
    const uint64_t h = mix64(seed * 0x9E3779B97F4A7C15ull + i + 1);
    return lo + (hi - lo) * static_cast<float>(h >> 40) / 16777216.0f;
}

// p[i] = the uniform value number first + i of `seed` (first: where p starts in a longer array).
__global__ void fill_uniform(float* p, size_t n, uint64_t seed, float lo, float hi, size_t first = 0) {
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<size_t>(gridDim.x) * blockDim.x)
        p[i] = hash_uniform(seed, first + i, lo, hi);
}

__global__ void fill_nibbles(uint32_t* q, size_t n_words, uint64_t seed) {
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n_words;
         i += static_cast<size_t>(gridDim.x) * blockDim.x) {
        const uint64_t h = mix64(seed * 0x9E3779B97F4A7C15ull + i + 1);
        uint32_t w = 0;
        for (int k = 0; k < 8; ++k) w |= static_cast<uint32_t>(1 + (h >> (5 * k)) % 15) << (4 * k);
        q[i] = w;
    }
}

// The README's quantiser: per group of 32, s = max|w| / 7, nibble = rint(w / s) + 8.
__global__ void quantize_groups(uint32_t* q, float* s, const float* w, size_t n_groups) {
    for (size_t g = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; g < n_groups;
         g += static_cast<size_t>(gridDim.x) * blockDim.x) {
        const float* v = w + g * 32;
        float mx = 0.0f;
        for (int k = 0; k < 32; ++k) mx = fmaxf(mx, fabsf(v[k]));
        const float sc = mx / 7.0f;
        s[g] = sc;
        for (int j = 0; j < 4; ++j) {
            uint32_t word = 0;
            for (int k = 0; k < 8; ++k) {
                const int nib = sc > 0.0f ? static_cast<int>(rintf(v[8 * j + k] / sc)) + 8 : 8;
                word |= static_cast<uint32_t>(min(15, max(1, nib))) << (4 * k);
            }
            q[g * 4 + j] = word;
        }
    }
}

__global__ void dequantize_rows(float* w, __nv_bfloat16* wb, const uint32_t* q, const float* s, size_t n) {
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<size_t>(gridDim.x) * blockDim.x) {
        const float v = static_cast<float>(static_cast<int>((q[i / 8] >> (4 * (i % 8))) & 15u) - 8) * s[i / 32];
        if (w) w[i] = v;
        if (wb) wb[i] = __float2bfloat16(v);
    }
}

__global__ void to_bf16(__nv_bfloat16* out, const float* in, size_t n) {
    const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
    if (i < n) out[i] = __float2bfloat16(in[i]);
}

__global__ void gather_rows(float* out, const float* in, const int* rows, int width) {
    const float* src = in + static_cast<long>(rows[blockIdx.x]) * width;
    for (int j = threadIdx.x; j < width; j += blockDim.x) out[static_cast<long>(blockIdx.x) * width + j] = src[j];
}

// out[t] = sum_j w[t][j] * y[pos[t * k + j]] + shared[t], j ascending.
__global__ void combine_rows(float* out, const float* y, const int* pos, const float* w, const float* shared, int T,
                             int k, int dim) {
    const long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x;
    if (i >= static_cast<long>(T) * dim) return;
    const int t = static_cast<int>(i / dim), d = static_cast<int>(i % dim);
    float acc = 0.0f;
    for (int j = 0; j < k; ++j) acc += w[t * k + j] * y[static_cast<long>(pos[t * k + j]) * dim + d];
    out[i] = acc + shared[i];
}

const int kFillGrid = 4096, kFillBlock = 256;

// Holds the stream until the host sets *flag (or about 2 s pass): the launches queued behind it
// then run back to back, so their GPU time leaves out the host's launch cost (nvbench's blocking
// kernel). --moe-probe only.
__global__ void block_on_flag(const volatile int* flag) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    while (*flag == 0) {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        if (t - t0 > 2000000000ull) break;
        __nanosleep(2000);
    }
}
__global__ void empty_kernel() {}

// ---- the read-bandwidth ceiling ----------------------------------------------------------

__global__ void read_only_kernel(const uint4* p, size_t n, uint32_t* sink) {
    uint32_t acc = 0;
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {  // four independent 16-byte loads in flight
        const uint4 a = ld_stream(p + i);
        const uint4 b = ld_stream(p + i + stride);
        const uint4 c = ld_stream(p + i + 2 * stride);
        const uint4 d = ld_stream(p + i + 3 * stride);
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    }
    for (; i < n; i += stride) {
        const uint4 a = ld_stream(p + i);
        acc ^= a.x ^ a.y ^ a.z ^ a.w;
    }
    if (acc == 0x9e3779b9u) *sink = acc;  // keeps the loads; practically never true
}

// ---- v1: the straightforward W4A16 kernel (one warp per row, 32-bit loads) -----------------

__global__ void w4a16_v1(float* y, const float* x, const uint32_t* q, const float* s, int M, int N, int K) {
    const int n = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
    if (n >= N) return;
    const uint32_t* qr = q + static_cast<long>(n) * (K / 8);
    const float* sr = s + static_cast<long>(n) * (K / 32);
    for (int m = 0; m < M; ++m) {
        float acc = 0.0f;
        for (int j = lane; j < K / 8; j += 32) {
            const uint32_t w = qr[j];
            const float sc = sr[j / 4];
            for (int k = 0; k < 8; ++k)
                acc += static_cast<float>(static_cast<int>((w >> (4 * k)) & 15u) - 8) * sc * x[m * K + 8 * j + k];
        }
        acc = warp_sum(acc);
        if (lane == 0) y[static_cast<long>(m) * N + n] = acc;
    }
}

// ---- timing -----------------------------------------------------------------------------

struct Timer {
    cudaEvent_t a, b;
    Timer() { cudaEventCreate(&a); cudaEventCreate(&b); }
    ~Timer() { cudaEventDestroy(a); cudaEventDestroy(b); }
    // Median over `reps` of the time of `calls` back-to-back calls of fn(i), divided by calls (us),
    // after a warm-up of whole passes (every fn(i) at least once: a graph's first launch uploads
    // it) lasting at least kWarmMs. Why the time: on an H100 the first ~1.7 ms of GPU work after
    // the GEMM table ran 13 % slower (126 us a K2 MoE layer instead of 111, 13-15 launches, any
    // graph: issue 38's seventh MoE pass); a warm-up of 4 calls left that transient in the timing.
    static constexpr double kWarmMs = 10.0;
    double per_call_us(cudaStream_t st, int reps, int calls, const std::function<void(int)>& fn) {
        const auto warm_start = std::chrono::steady_clock::now();
        do {
            for (int i = 0; i < calls; ++i) fn(i);
            KD_CUDA_CHECK(cudaStreamSynchronize(st));
        } while (std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - warm_start).count() < kWarmMs);
        std::vector<double> t;
        for (int r = 0; r < reps; ++r) {
            KD_CUDA_CHECK(cudaEventRecord(a, st));
            for (int i = 0; i < calls; ++i) fn(i);
            KD_CUDA_CHECK(cudaEventRecord(b, st));
            KD_CUDA_CHECK(cudaEventSynchronize(b));
            float ms = 0;
            KD_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
            t.push_back(1000.0 * ms / calls);
        }
        std::sort(t.begin(), t.end());
        return t[t.size() / 2];
    }
};

// work()'s launches on `st`, captured into a graph and instantiated (not launched).
cudaGraphExec_t capture_graph(cudaStream_t st, const std::function<void()>& work) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    KD_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    work();
    KD_CUDA_CHECK(cudaStreamEndCapture(st, &g));
    KD_CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
    KD_CUDA_CHECK(cudaGraphDestroy(g));
    return ge;
}

template <class T>
T* dev_alloc(size_t n) {
    T* p = nullptr;
    KD_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
    return p;
}

// The backend's tiled copy (upload_w4a16's layout) of n_sets stacked N x K INT4 matrices in the
// bundle's layout, on the device.
std::pair<uint32_t*, float*> tiled(Context& ctx, const uint32_t* q, const float* s, int N, int K, int n_sets = 1) {
    const size_t tw = w4a16_tiled_words(N, K), ts = w4a16_tiled_scales(N, K);
    uint32_t* dq = dev_alloc<uint32_t>(tw * n_sets);
    float* ds = dev_alloc<float>(ts * n_sets);
    for (int e = 0; e < n_sets; ++e)
        w4a16_tile(ctx, dq + e * tw, ds + e * ts, q + static_cast<size_t>(e) * N * K / 8,
                   s + static_cast<size_t>(e) * N * K / 32, N, K);
    return {dq, ds};
}

// Work runs on a non-blocking stream, which a plain cudaMemcpy does not wait for.
cudaStream_t g_stream = nullptr;
// --moe-probe: what the MoE layer's one-graph-per-layer time is made of (printed, not in the JSON).
bool g_moe_probe = false;

template <class T>
std::vector<T> to_host(const T* d, size_t n) {
    std::vector<T> h(n);
    KD_CUDA_CHECK(cudaMemcpyAsync(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost, g_stream));
    KD_CUDA_CHECK(cudaStreamSynchronize(g_stream));
    return h;
}

double nmse(const std::vector<float>& a, const std::vector<float>& b) {
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
        den += static_cast<double>(b[i]) * b[i];
    }
    return den > 0 ? num / den : num;
}

// A tiny JSON writer for the report.
struct JsonOut {
    std::ostringstream s;
    bool first = true;
    void key(const std::string& k) { s << (first ? "" : ", ") << '"' << k << "\": "; first = false; }
    void num(const std::string& k, double v) { key(k); if (std::isfinite(v)) s << v; else s << "null"; }
    void raw(const std::string& k, const std::string& v) { key(k); s << v; }
    std::string obj() const { return "{" + s.str() + "}"; }
};

// ---- 1. ceiling --------------------------------------------------------------------------

double bench_ceiling(Context& ctx, double& copy_gbs) {
    const size_t bytes = 4ull << 30;
    uint4* buf = dev_alloc<uint4>(bytes / 16);
    uint4* dst = dev_alloc<uint4>(bytes / 32);
    uint32_t* sink = dev_alloc<uint32_t>(1);
    fill_nibbles<<<kFillGrid, kFillBlock, 0, ctx.stream>>>(reinterpret_cast<uint32_t*>(buf), bytes / 4, 1);
    KD_CUDA_LAUNCH_CHECK("fill");
    Timer tm;
    const int grid = ctx.num_sms * 4;
    const double us = tm.per_call_us(ctx.stream, 10, 1, [&](int) {
        read_only_kernel<<<grid, 512, 0, ctx.stream>>>(buf, bytes / 16, sink);
    });
    KD_CUDA_LAUNCH_CHECK("read_only_kernel");
    const double copy_us = tm.per_call_us(ctx.stream, 10, 1, [&](int) {
        KD_CUDA_CHECK(cudaMemcpyAsync(dst, buf, bytes / 2, cudaMemcpyDeviceToDevice, ctx.stream));
    });
    copy_gbs = 2.0 * (bytes / 2) / copy_us / 1e3;  // bytes read + written
    KD_CUDA_CHECK(cudaFree(buf));
    KD_CUDA_CHECK(cudaFree(dst));
    KD_CUDA_CHECK(cudaFree(sink));
    return bytes / us / 1e3;  // GB/s
}

// ---- 2. w4a16 GEMM ----------------------------------------------------------------------

std::string bench_gemm(Context& ctx, int N, int K, double ceiling, bool quick, int& failures) {
    auto handle = static_cast<cublasHandle_t>(ctx.cublas);
    const size_t nw = static_cast<size_t>(N) * K;
    // Copies so that one rotation moves >= 512 MB of INT4 weights (several times the L2).
    const int copies_q = std::max(2, static_cast<int>((512ull << 20) / (nw * 5 / 8) + 1));
    const int copies_f = std::max(2, static_cast<int>((512ull << 20) / (nw * 4) + 1));
    const int copies_b = std::max(2, static_cast<int>((512ull << 20) / (nw * 2) + 1));
    std::vector<uint32_t*> q(copies_q), tq(copies_q);  // the bundle's layout, the backend's tiled one
    std::vector<float*> s(copies_q), ts(copies_q);
    for (int c = 0; c < copies_q; ++c) {
        q[c] = dev_alloc<uint32_t>(nw / 8);
        s[c] = dev_alloc<float>(nw / 32);
        fill_nibbles<<<kFillGrid, kFillBlock, 0, ctx.stream>>>(q[c], nw / 8, 100 + c);
        fill_uniform<<<kFillGrid, kFillBlock, 0, ctx.stream>>>(s[c], nw / 32, 200 + c, 0.002f, 0.02f);
        std::tie(tq[c], ts[c]) = tiled(ctx, q[c], s[c], N, K);
    }
    std::vector<float*> wf(copies_f);
    std::vector<__nv_bfloat16*> wb(copies_b);
    for (int c = 0; c < copies_f; ++c) {
        wf[c] = dev_alloc<float>(nw);
        dequantize_rows<<<kFillGrid, kFillBlock, 0, ctx.stream>>>(wf[c], nullptr, q[c % copies_q], s[c % copies_q], nw);
    }
    for (int c = 0; c < copies_b; ++c) {
        wb[c] = dev_alloc<__nv_bfloat16>(nw);
        dequantize_rows<<<kFillGrid, kFillBlock, 0, ctx.stream>>>(nullptr, wb[c], q[c % copies_q], s[c % copies_q], nw);
    }
    KD_CUDA_LAUNCH_CHECK("weights");
    const int Mmax = 16;
    float* x = dev_alloc<float>(static_cast<size_t>(Mmax) * K);
    __nv_bfloat16* xb = dev_alloc<__nv_bfloat16>(static_cast<size_t>(Mmax) * K);
    float* y = dev_alloc<float>(static_cast<size_t>(Mmax) * N);
    float* y2 = dev_alloc<float>(static_cast<size_t>(Mmax) * N);
    fill_uniform<<<kFillGrid, kFillBlock, 0, ctx.stream>>>(x, static_cast<size_t>(Mmax) * K, 7, -1.0f, 1.0f);
    to_bf16<<<ceil_div(static_cast<long>(Mmax) * K, 256), 256, 0, ctx.stream>>>(xb, x, static_cast<size_t>(Mmax) * K);
    KD_CUDA_LAUNCH_CHECK("inputs");

    Timer tm;
    const int reps = quick ? 5 : 15;
    std::ostringstream rows;
    bool first = true;
    for (const int M : {1, 2, 4, 8, 16}) {
        // Validate v2 (copy 0) against a double-precision reference on sampled rows.
        matmul_w4a16(ctx, y, x, reinterpret_cast<const int32_t*>(tq[0]), ts[0], M, N, K);
        const std::vector<float> got = to_host(y, static_cast<size_t>(M) * N);
        const std::vector<uint32_t> hq = to_host(q[0], nw / 8);
        const std::vector<float> hs = to_host(s[0], nw / 32), hx = to_host(x, static_cast<size_t>(M) * K);
        std::vector<float> ref, mine;
        for (int n = 0; n < N; n += std::max(1, N / 128))
            for (int m = 0; m < M; ++m) {
                double acc = 0;
                for (int k = 0; k < K; ++k) {
                    const size_t i = static_cast<size_t>(n) * K + k;
                    acc += (static_cast<double>((hq[i / 8] >> (4 * (i % 8))) & 15u) - 8.0) * hs[i / 32] * hx[m * K + k];
                }
                ref.push_back(static_cast<float>(acc));
                mine.push_back(got[static_cast<size_t>(m) * N + n]);
            }
        const double err = nmse(mine, ref);
        // Row independence: row 0 of the M-row call equals the M = 1 call bit for bit.
        matmul_w4a16(ctx, y2, x, reinterpret_cast<const int32_t*>(tq[0]), ts[0], 1, N, K);
        const std::vector<float> one = to_host(y2, static_cast<size_t>(N));
        const bool rows_exact = std::equal(one.begin(), one.end(), got.begin());
        w4a16_v1<<<ceil_div(N, 8), 256, 0, ctx.stream>>>(y2, x, q[0], s[0], M, N, K);
        KD_CUDA_LAUNCH_CHECK("w4a16_v1");
        const double err_v1 = nmse(to_host(y2, static_cast<size_t>(M) * N), got);
        const bool ok = err < 1e-9 && rows_exact && err_v1 < 1e-9;
        if (!ok) ++failures;

        const double t_v2 = tm.per_call_us(ctx.stream, reps, copies_q, [&](int c) {
            matmul_w4a16(ctx, y, x, reinterpret_cast<const int32_t*>(tq[c]), ts[c], M, N, K);
        });
        const double t_v1 = tm.per_call_us(ctx.stream, reps, copies_q, [&](int c) {
            w4a16_v1<<<ceil_div(N, 8), 256, 0, ctx.stream>>>(y2, x, q[c], s[c], M, N, K);
        });
        const float one_f = 1.0f, zero_f = 0.0f;
        const double t_sgemm = tm.per_call_us(ctx.stream, reps, copies_f, [&](int c) {
            CUBLAS_CHECK(cublasSgemm(handle, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one_f, wf[c], K, x, K, &zero_f, y2, N));
        });
        const double t_bf16 = tm.per_call_us(ctx.stream, reps, copies_b, [&](int c) {
            CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one_f, wb[c], CUDA_R_16BF, K, xb,
                                      CUDA_R_16BF, K, &zero_f, y2, CUDA_R_32F, N, CUBLAS_COMPUTE_32F,
                                      CUBLAS_GEMM_DEFAULT));
        });
        const double act = 4.0 * M * (static_cast<double>(K) + N);
        const double b_q = nw * 0.625 + act, b_f = nw * 4.0 + act, b_b = nw * 2.0 + act / 2;
        const double gbs = b_q / t_v2 / 1e3;
        std::printf("  %5d x %-5d M=%-2d  v2 %8.2f us %7.0f GB/s %5.1f%%  | v1 %8.2f us %5.1f%% | sgemm %8.2f us %7.0f GB/s"
                    " | bf16 %8.2f us %7.0f GB/s | nmse %.1e rows %s %s\n",
                    N, K, M, t_v2, gbs, 100.0 * gbs / ceiling, t_v1, 100.0 * b_q / t_v1 / 1e3 / ceiling, t_sgemm,
                    b_f / t_sgemm / 1e3, t_bf16, b_b / t_bf16 / 1e3, err, rows_exact ? "exact" : "DIFFER",
                    ok ? "" : "FAILED");
        std::fflush(stdout);
        JsonOut j;
        j.num("N", N); j.num("K", K); j.num("M", M);
        j.num("w4a16_us", t_v2); j.num("w4a16_GBps", gbs); j.num("w4a16_pct_ceiling", 100.0 * gbs / ceiling);
        j.num("w4a16_v1_us", t_v1);
        j.num("cublas_sgemm_us", t_sgemm); j.num("cublas_sgemm_GBps", b_f / t_sgemm / 1e3);
        j.num("cublas_bf16_us", t_bf16); j.num("cublas_bf16_GBps", b_b / t_bf16 / 1e3);
        j.num("speedup_vs_sgemm", t_sgemm / t_v2); j.num("speedup_vs_bf16", t_bf16 / t_v2);
        j.num("nmse_vs_reference", err); j.raw("rows_independent_of_M", rows_exact ? "true" : "false");
        j.raw("valid", ok ? "true" : "false");
        rows << (first ? "" : ",\n    ") << j.obj();
        first = false;
    }
    for (auto* p : q) cudaFree(p);
    for (auto* p : s) cudaFree(p);
    for (auto* p : tq) cudaFree(p);
    for (auto* p : ts) cudaFree(p);
    for (auto* p : wf) cudaFree(p);
    for (auto* p : wb) cudaFree(p);
    cudaFree(x); cudaFree(xb); cudaFree(y); cudaFree(y2);
    return rows.str();
}

// ---- 3. the K2-shaped MoE layer -------------------------------------------------------------

// Experts are stacked [E + 1][..][..]: the routed ones, then the shared expert, as the engine's
// model stacks them (ExpertWeights::shared).
struct MoeLayer {
    int h = 7168, E = 384, k = 8, inter = 2048;
    float* gate_w = nullptr;   // [E][h]
    float* gate_b = nullptr;   // [E]
    float* w[3] = {};          // fp32 experts: w1, w2, w3 stacked [E + 1][..][..]
    uint32_t* q[3] = {};       // INT4 experts, the backend's tiled layout (upload_w4a16's)
    float* s[3] = {};
    const float* sw[3] = {};   // the shared expert inside those stacks
    const uint32_t* sq[3] = {};
    const float* ss[3] = {};
};

// Scratch for one layer call of up to 16 tokens.
struct MoeBuffers {
    float *logits, *weight, *xn, *out, *sh_a, *sh_b, *sh_y;
    int32_t* idx;  // [T][k]
    // cuBLAS FP32 path
    float *xs, *ha, *hb, *ys;
    int* d_rows;  // [2 * 16 * k]: pair rows, then pair positions
};

// The layer through the backend's ops as the engine's model runs it: the router (matmul_f32),
// moe_gate_ffn with the shared expert stacked after the routed ones. separate = true: the
// shared expert as three matmuls, silu_mul and an add (the model's path for a shared expert that
// cannot be stacked; the same output).
void moe_int4_layer(Context& ctx, const MoeLayer& L, const MoeBuffers& b, const float* x, int T, bool int4,
                    bool separate = false) {
    const MoeRouting r{L.E, L.k, 1, 1, 2.827f};
    matmul_f32(ctx, b.logits, x, L.gate_w, nullptr, T, L.E, L.h);
    ExpertWeights ew;
    ew.n_experts = L.E; ew.dim = L.h; ew.inter = L.inter; ew.int4 = int4; ew.shared = !separate;
    if (int4) {
        ew.q1 = reinterpret_cast<const int32_t*>(L.q[0]); ew.q2 = reinterpret_cast<const int32_t*>(L.q[1]);
        ew.q3 = reinterpret_cast<const int32_t*>(L.q[2]);
        ew.s1 = L.s[0]; ew.s2 = L.s[1]; ew.s3 = L.s[2];
    } else {
        ew.w1 = L.w[0]; ew.w2 = L.w[1]; ew.w3 = L.w[2];
    }
    moe_gate_ffn(ctx, b.out, x, b.idx, b.weight, b.logits, L.gate_b, T, r, ew);
    if (!separate) return;
    if (int4) {
        matmul_w4a16(ctx, b.sh_a, x, reinterpret_cast<const int32_t*>(L.sq[0]), L.ss[0], T, L.inter, L.h);
        matmul_w4a16(ctx, b.sh_b, x, reinterpret_cast<const int32_t*>(L.sq[2]), L.ss[2], T, L.inter, L.h);
        silu_mul(ctx, b.sh_a, b.sh_a, b.sh_b, static_cast<size_t>(T) * L.inter);
        matmul_w4a16(ctx, b.sh_y, b.sh_a, reinterpret_cast<const int32_t*>(L.sq[1]), L.ss[1], T, L.h, L.inter);
    } else {
        matmul_f32_kernel(ctx, b.sh_a, x, L.sw[0], nullptr, T, L.inter, L.h);
        matmul_f32_kernel(ctx, b.sh_b, x, L.sw[2], nullptr, T, L.inter, L.h);
        silu_mul(ctx, b.sh_a, b.sh_a, b.sh_b, static_cast<size_t>(T) * L.inter);
        matmul_f32_kernel(ctx, b.sh_y, b.sh_a, L.sw[1], nullptr, T, L.h, L.inter);
    }
    add(ctx, b.out, b.out, b.sh_y, static_cast<size_t>(T) * L.h);
}

// FP32 through cuBLAS, as an engine without a grouped kernel runs it: routing read back to the
// host, then per selected expert SGEMMs over its gathered tokens (no TF32).
void moe_fp32_cublas_layer(Context& ctx, const MoeLayer& L, const MoeBuffers& b, const float* x, int T) {
    auto handle = static_cast<cublasHandle_t>(ctx.cublas);
    const float one = 1.0f, zero = 0.0f;
    const MoeRouting r{L.E, L.k, 1, 1, 2.827f};
    CUBLAS_CHECK(cublasSgemm(handle, CUBLAS_OP_T, CUBLAS_OP_N, L.E, T, L.h, &one, L.gate_w, L.h, x, L.h, &zero,
                             b.logits, L.E));
    moe_gate(ctx, b.idx, b.weight, b.logits, L.gate_b, T, r);
    std::vector<int32_t> idx(static_cast<size_t>(T) * L.k);
    KD_CUDA_CHECK(cudaMemcpyAsync(idx.data(), b.idx, idx.size() * sizeof(int32_t), cudaMemcpyDeviceToHost, ctx.stream));
    KD_CUDA_CHECK(cudaStreamSynchronize(ctx.stream));
    // Pairs sorted by expert: rows[p] = token, pos[pair id] = p.
    std::vector<int> order(idx.size()), rows(idx.size()), pos(idx.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
    std::stable_sort(order.begin(), order.end(), [&](int a, int c) { return idx[a] < idx[c]; });
    for (size_t p = 0; p < order.size(); ++p) { rows[p] = order[p] / L.k; pos[order[p]] = static_cast<int>(p); }
    std::vector<int> host(2 * rows.size());
    std::copy(rows.begin(), rows.end(), host.begin());
    std::copy(pos.begin(), pos.end(), host.begin() + static_cast<long>(rows.size()));
    KD_CUDA_CHECK(cudaMemcpyAsync(b.d_rows, host.data(), host.size() * sizeof(int), cudaMemcpyHostToDevice, ctx.stream));
    const int P = static_cast<int>(rows.size());
    gather_rows<<<P, 256, 0, ctx.stream>>>(b.xs, x, b.d_rows, L.h);
    KD_CUDA_LAUNCH_CHECK("gather_rows");
    const long per = static_cast<long>(L.inter) * L.h;
    for (int p0 = 0; p0 < P;) {
        const int e = idx[order[p0]];
        int p1 = p0;
        while (p1 < P && idx[order[p1]] == e) ++p1;
        const int n = p1 - p0;
        CUBLAS_CHECK(cublasSgemm(handle, CUBLAS_OP_T, CUBLAS_OP_N, L.inter, n, L.h, &one, L.w[0] + e * per, L.h,
                                 b.xs + static_cast<long>(p0) * L.h, L.h, &zero, b.ha + static_cast<long>(p0) * L.inter,
                                 L.inter));
        CUBLAS_CHECK(cublasSgemm(handle, CUBLAS_OP_T, CUBLAS_OP_N, L.inter, n, L.h, &one, L.w[2] + e * per, L.h,
                                 b.xs + static_cast<long>(p0) * L.h, L.h, &zero, b.hb + static_cast<long>(p0) * L.inter,
                                 L.inter));
        p0 = p1;
    }
    silu_mul(ctx, b.ha, b.ha, b.hb, static_cast<size_t>(P) * L.inter);
    for (int p0 = 0; p0 < P;) {
        const int e = idx[order[p0]];
        int p1 = p0;
        while (p1 < P && idx[order[p1]] == e) ++p1;
        CUBLAS_CHECK(cublasSgemm(handle, CUBLAS_OP_T, CUBLAS_OP_N, L.h, p1 - p0, L.inter, &one, L.w[1] + e * per,
                                 L.inter, b.ha + static_cast<long>(p0) * L.inter, L.inter, &zero,
                                 b.ys + static_cast<long>(p0) * L.h, L.h));
        p0 = p1;
    }
    CUBLAS_CHECK(cublasSgemm(handle, CUBLAS_OP_T, CUBLAS_OP_N, L.inter, T, L.h, &one, L.sw[0], L.h, x, L.h, &zero,
                             b.sh_a, L.inter));
    CUBLAS_CHECK(cublasSgemm(handle, CUBLAS_OP_T, CUBLAS_OP_N, L.inter, T, L.h, &one, L.sw[2], L.h, x, L.h, &zero,
                             b.sh_b, L.inter));
    silu_mul(ctx, b.sh_a, b.sh_a, b.sh_b, static_cast<size_t>(T) * L.inter);
    CUBLAS_CHECK(cublasSgemm(handle, CUBLAS_OP_T, CUBLAS_OP_N, L.h, T, L.inter, &one, L.sw[1], L.inter, b.sh_a, L.inter,
                             &zero, b.sh_y, L.h));
    const long n = static_cast<long>(T) * L.h;
    combine_rows<<<ceil_div(n, 256), 256, 0, ctx.stream>>>(b.out, b.ys, b.d_rows + P, b.weight, b.sh_y, T, L.k, L.h);
    KD_CUDA_LAUNCH_CHECK("combine_rows");
}

// The layer's byte limit at T tokens, averaged over the timed input batches: what it must read
// at least, the router's fp32 weights and bias (E x h + E floats) and, for every expert the
// tokens select (each distinct routed expert once, plus the shared one), its three INT4
// matrices' nibbles and fp32 group scales (3 x inter x h x (1/2 + 4/32) bytes). Activations
// and outputs (a few KB) are left out. The routing is the INT4 layer's own, read back after a run.
double moe_byte_limit(Context& ctx, const MoeLayer& L, const MoeBuffers& b, const std::function<const float*(int)>& xi,
                      int T, int n_inputs) {
    const double router = (static_cast<double>(L.E) * L.h + L.E) * 4.0;
    const double expert = 3.0 * L.inter * static_cast<double>(L.h) * (0.5 + 4.0 / 32);
    double total = 0;
    for (int i = 0; i < n_inputs; ++i) {
        moe_int4_layer(ctx, L, b, xi(i), T, true);
        std::vector<int32_t> idx = to_host(b.idx, static_cast<size_t>(T) * L.k);
        std::sort(idx.begin(), idx.end());
        const long distinct = std::unique(idx.begin(), idx.end()) - idx.begin();
        total += router + (distinct + 1) * expert;
    }
    return total / n_inputs;
}

// only_T > 0: that batch size alone, the four paths once each, nothing timed (for a profiler).
// An output's bits (FNV-1a over the floats): two builds of a kernel compare by it.
uint64_t output_bits(const std::vector<float>& out) {
    uint64_t bits = 1469598103934665603ull;
    for (const float v : out) {
        uint32_t u;
        std::memcpy(&u, &v, 4);
        bits = (bits ^ u) * 1099511628211ull;
    }
    return bits;
}

// --moe-probe: the MoE layer timed in other ways (issue 38, sixth MoE pass). run(): calls
// launches of launch(i) a repetition, after `warm` of them once; per layer, the GPU time between
// the repetition's first and last events, and the host's time in the launch calls; "queued": the
// launches wait behind block_on_flag until all are issued, so the GPU runs them back to back
// whatever the host's launch cost; "pos": an event after every call and the median interval of
// each (every repetition's with all_reps).
struct LayerProbe {
    Context& ctx;
    int T;
    int* flag_h = nullptr;
    int* flag_d = nullptr;
    std::vector<cudaEvent_t> ev = std::vector<cudaEvent_t>(66);
    LayerProbe(Context& c, int t) : ctx(c), T(t) {
        KD_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&flag_h), sizeof(int), cudaHostAllocMapped));
        KD_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&flag_d), flag_h, 0));
        for (auto& e : ev) KD_CUDA_CHECK(cudaEventCreate(&e));
    }
    ~LayerProbe() {
        for (auto& e : ev) cudaEventDestroy(e);
        cudaFreeHost(flag_h);
    }
    // A graph of work(); warm: uploaded and launched once.
    cudaGraphExec_t capture(const std::function<void()>& work, bool warm = true) {
        const cudaGraphExec_t ge = capture_graph(ctx.stream, work);
        if (warm) {
            KD_CUDA_CHECK(cudaGraphUpload(ge, ctx.stream));
            KD_CUDA_CHECK(cudaGraphLaunch(ge, ctx.stream));
        }
        KD_CUDA_CHECK(cudaStreamSynchronize(ctx.stream));
        return ge;
    }
    static double pct(std::vector<double> v, double q) {
        std::sort(v.begin(), v.end());
        return v[static_cast<size_t>(q * (v.size() - 1) + 0.5)];
    }
    void run(const char* name, int calls, int layers, bool queued, bool pos, const std::function<void(int)>& launch,
             int reps = 21, int warm = 8, bool all_reps = false) {
        std::vector<double> gpu, host;
        std::vector<std::vector<double>> at(pos ? calls : 0);
        for (int i = 0; i < std::min(calls, warm); ++i) launch(i);
        KD_CUDA_CHECK(cudaStreamSynchronize(ctx.stream));
        for (int r = 0; r < reps; ++r) {
            if (queued) {
                *reinterpret_cast<volatile int*>(flag_h) = 0;
                std::atomic_thread_fence(std::memory_order_seq_cst);
                block_on_flag<<<1, 1, 0, ctx.stream>>>(flag_d);
            }
            KD_CUDA_CHECK(cudaEventRecord(ev[0], ctx.stream));
            const auto h0 = std::chrono::steady_clock::now();
            for (int i = 0; i < calls; ++i) {
                launch(i);
                if (pos) KD_CUDA_CHECK(cudaEventRecord(ev[1 + i], ctx.stream));
            }
            const auto h1 = std::chrono::steady_clock::now();
            KD_CUDA_CHECK(cudaEventRecord(ev[65], ctx.stream));
            if (queued) {
                std::atomic_thread_fence(std::memory_order_seq_cst);
                *reinterpret_cast<volatile int*>(flag_h) = 1;
            }
            KD_CUDA_CHECK(cudaEventSynchronize(ev[65]));
            float ms = 0;
            KD_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[0], ev[65]));
            gpu.push_back(1000.0 * ms / calls / layers);
            host.push_back(std::chrono::duration<double, std::micro>(h1 - h0).count() / calls);
            for (int i = 0; pos && i < calls; ++i) {
                KD_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[i], ev[1 + i]));
                at[i].push_back(1000.0 * ms);
            }
            if (all_reps) {
                std::printf("  probe T=%d %-36s rep %d: us a layer %7.1f, host launch a call %7.1f | each call:", T, name, r,
                            gpu.back(), host.back());
                for (auto& v : at) std::printf(" %.1f", v.back());
                std::printf("\n");
            }
        }
        std::printf("  probe T=%d %-36s us a layer %7.1f [p10 %7.1f p90 %7.1f] | host launch a call %7.1f [p10 %7.1f p90 %7.1f]",
                    T, name, pct(gpu, 0.5), pct(gpu, 0.1), pct(gpu, 0.9), pct(host, 0.5), pct(host, 0.1), pct(host, 0.9));
        if (pos) {
            std::printf(" | each call:");
            for (auto& v : at) std::printf(" %.1f", pct(v, 0.5));
        }
        std::printf("\n");
        std::fflush(stdout);
    }
};

// int4_only (with only_T, --moe-int4): no FP32 expert stacks (3 x 22.6 GB at K2 width), so that
// ncu's multi-pass sections can save and restore the device's memory; the FP32 paths are skipped.
std::string bench_moe(Context& ctx, double ceiling, bool quick, int& failures, int only_T = 0, bool int4_only = false) {
    MoeLayer L;
    const long per = static_cast<long>(L.inter) * L.h;
    const size_t all = static_cast<size_t>(L.E + 1) * per;
    L.gate_w = dev_alloc<float>(static_cast<size_t>(L.E) * L.h);
    L.gate_b = dev_alloc<float>(L.E);
    fill_uniform<<<kFillGrid, kFillBlock, 0, ctx.stream>>>(L.gate_w, static_cast<size_t>(L.E) * L.h, 11, -0.05f, 0.05f);
    fill_uniform<<<kFillGrid, kFillBlock, 0, ctx.stream>>>(L.gate_b, L.E, 12, -0.02f, 0.02f);
    // Each expert's matrix is made (in its stack, or with int4_only in one scratch buffer: the same
    // values) and quantised from there.
    float* scratch = int4_only ? dev_alloc<float>(per) : nullptr;
    for (int j = 0; j < 3; ++j) {
        if (!int4_only) L.w[j] = dev_alloc<float>(all);
        uint32_t* q = dev_alloc<uint32_t>(all / 8);
        float* s = dev_alloc<float>(all / 32);
        for (long e = 0; e <= L.E; ++e) {
            float* w = int4_only ? scratch : L.w[j] + e * per;
            fill_uniform<<<kFillGrid, kFillBlock, 0, ctx.stream>>>(w, per, 20 + j, -0.03f, 0.03f, e * per);
            quantize_groups<<<kFillGrid, kFillBlock, 0, ctx.stream>>>(q + e * per / 8, s + e * per / 32, w, per / 32);
        }
        const int out = j == 1 ? L.h : L.inter, in = j == 1 ? L.inter : L.h;
        std::tie(L.q[j], L.s[j]) = tiled(ctx, q, s, out, in, L.E + 1);
        cudaFree(q);
        cudaFree(s);
        L.sw[j] = L.w[j] ? L.w[j] + L.E * per : nullptr;
        L.sq[j] = L.q[j] + L.E * w4a16_tiled_words(out, in);
        L.ss[j] = L.s[j] + L.E * w4a16_tiled_scales(out, in);
    }
    KD_CUDA_LAUNCH_CHECK("moe weights");
    cudaFree(scratch);  // (waits for the launches that use it)
    const int Tmax = 16, P = Tmax * L.k, n_inputs = 8;
    MoeBuffers b{};
    b.logits = dev_alloc<float>(static_cast<size_t>(Tmax) * L.E);
    b.weight = dev_alloc<float>(P);
    b.idx = dev_alloc<int32_t>(P);
    b.out = dev_alloc<float>(static_cast<size_t>(Tmax) * L.h);
    b.sh_a = dev_alloc<float>(static_cast<size_t>(Tmax) * L.inter);
    b.sh_b = dev_alloc<float>(static_cast<size_t>(Tmax) * L.inter);
    b.sh_y = dev_alloc<float>(static_cast<size_t>(Tmax) * L.h);
    b.xs = dev_alloc<float>(static_cast<size_t>(P) * L.h);
    b.ha = dev_alloc<float>(static_cast<size_t>(P) * L.inter);
    b.hb = dev_alloc<float>(static_cast<size_t>(P) * L.inter);
    b.ys = dev_alloc<float>(static_cast<size_t>(P) * L.h);
    b.d_rows = dev_alloc<int>(2 * P);
    // Several token batches: consecutive calls route to different experts (no L2 reuse).
    float* xin = dev_alloc<float>(static_cast<size_t>(n_inputs) * Tmax * L.h);
    fill_uniform<<<kFillGrid, kFillBlock, 0, ctx.stream>>>(xin, static_cast<size_t>(n_inputs) * Tmax * L.h, 40, -1.0f, 1.0f);
    float* out_ref = dev_alloc<float>(static_cast<size_t>(Tmax) * L.h);
    KD_CUDA_CHECK(cudaStreamSynchronize(ctx.stream));

    Timer tm;
    const int reps = quick ? 5 : 11;
    std::ostringstream rows;
    bool first = true;
    for (int T = 1; T <= Tmax; ++T) {
        if (only_T ? T != only_T : quick && T != 1 && T != 4 && T != 16) continue;
        auto xi = [&](int i) { return xin + static_cast<size_t>(i % n_inputs) * Tmax * L.h; };
        // Compare the three paths on input 0 (int4_only: the two INT4 ones).
        std::vector<float> ref;
        double err_f32 = 0.0;
        if (!int4_only) {
            moe_fp32_cublas_layer(ctx, L, b, xi(0), T);
            KD_CUDA_CHECK(cudaMemcpyAsync(out_ref, b.out, sizeof(float) * T * L.h, cudaMemcpyDeviceToDevice, ctx.stream));
            ref = to_host(out_ref, static_cast<size_t>(T) * L.h);
            moe_int4_layer(ctx, L, b, xi(0), T, false);
            err_f32 = nmse(to_host(b.out, static_cast<size_t>(T) * L.h), ref);
        }
        moe_int4_layer(ctx, L, b, xi(0), T, true, true);
        const std::vector<float> separate = to_host(b.out, static_cast<size_t>(T) * L.h);
        moe_int4_layer(ctx, L, b, xi(0), T, true);
        const std::vector<float> q4 = to_host(b.out, static_cast<size_t>(T) * L.h);
        const double err_q = int4_only ? 0.0 : nmse(q4, ref);
        const bool same = separate == q4;  // the shared expert stacked or on its own: the same bits
        const bool ok = err_f32 < 1e-9 && err_q < 5e-2 && same;  // INT4 vs FP32: quantisation noise
        if (!ok) ++failures;
        // Time per replay of work(i) captured once per input batch (pointers are baked into a graph).
        const auto graph_us = [&](const std::function<void(int)>& work) {
            std::vector<cudaGraphExec_t> graphs(n_inputs);
            for (int i = 0; i < n_inputs; ++i) graphs[i] = capture_graph(ctx.stream, [&] { work(i); });
            const double us = tm.per_call_us(ctx.stream, reps, n_inputs, [&](int i) {
                KD_CUDA_CHECK(cudaGraphLaunch(graphs[i], ctx.stream));
            });
            for (auto& g : graphs) cudaGraphExecDestroy(g);
            return us;
        };
        // Time per call of work(i) when all n_inputs calls are one graph (as a forward's graph
        // holds every layer): no graph-launch boundary between consecutive calls.
        const auto one_graph_us = [&](const std::function<void(int)>& work) {
            const cudaGraphExec_t ge = capture_graph(ctx.stream, [&] {
                for (int i = 0; i < n_inputs; ++i) work(i);
            });
            const double us = tm.per_call_us(ctx.stream, reps, 1, [&](int) { KD_CUDA_CHECK(cudaGraphLaunch(ge, ctx.stream)); });
            cudaGraphExecDestroy(ge);
            return us / n_inputs;
        };
        if (only_T) {
            if (int4_only)
                std::printf("  T=%d INT4 only (no FP32 reference), shared expert stacked == separate: %s %s\n", T,
                            same ? "yes" : "NO", ok ? "" : "FAILED");
            else
                std::printf("  T=%d nmse int4 %.1e fp32 %.1e, shared expert stacked == separate: %s %s\n", T, err_q,
                            err_f32, same ? "yes" : "NO", ok ? "" : "FAILED");
            // The INT4 layer's stages, each alone in a graph (routing as left by the last call).
            ExpertWeights ew;
            ew.n_experts = L.E; ew.dim = L.h; ew.inter = L.inter; ew.int4 = true;
            ew.q1 = reinterpret_cast<const int32_t*>(L.q[0]); ew.q2 = reinterpret_cast<const int32_t*>(L.q[1]);
            ew.q3 = reinterpret_cast<const int32_t*>(L.q[2]);
            ew.s1 = L.s[0]; ew.s2 = L.s[1]; ew.s3 = L.s[2];
            const MoeRouting r{L.E, L.k, 1, 1, 2.827f};
            const auto stage = [&](const char* name, const std::function<void(int)>& work) {
                std::printf("    %-44s %7.1f us\n", name, graph_us(work));
            };
            stage("router matmul_f32 (cuBLAS, 16-row pass)", [&](int i) {
                matmul_f32(ctx, b.logits, xi(i), L.gate_w, nullptr, T, L.E, L.h);
            });
            stage("router matmul_f32_kernel", [&](int i) {
                matmul_f32_kernel(ctx, b.logits, xi(i), L.gate_w, nullptr, T, L.E, L.h);
            });
            stage("silu_mul over 2048 (a one-kernel floor)", [&](int) {
                silu_mul(ctx, b.sh_a, b.sh_a, b.sh_b, static_cast<size_t>(T) * L.inter);
            });
            stage("moe_gate", [&](int) { moe_gate(ctx, b.idx, b.weight, b.logits, L.gate_b, T, r); });
            stage("moe_ffn, routed experts", [&](int i) { moe_ffn(ctx, b.out, xi(i), b.idx, b.weight, T, L.k, ew); });
            ew.shared = true;
            stage("moe_ffn, routed + shared expert", [&](int i) { moe_ffn(ctx, b.out, xi(i), b.idx, b.weight, T, L.k, ew); });
            stage("shared expert: 3 matmul_w4a16 + silu_mul + add", [&](int i) {
                matmul_w4a16(ctx, b.sh_a, xi(i), reinterpret_cast<const int32_t*>(L.sq[0]), L.ss[0], T, L.inter, L.h);
                matmul_w4a16(ctx, b.sh_b, xi(i), reinterpret_cast<const int32_t*>(L.sq[2]), L.ss[2], T, L.inter, L.h);
                silu_mul(ctx, b.sh_a, b.sh_a, b.sh_b, static_cast<size_t>(T) * L.inter);
                matmul_w4a16(ctx, b.sh_y, b.sh_a, reinterpret_cast<const int32_t*>(L.sq[1]), L.ss[1], T, L.h, L.inter);
                add(ctx, b.out, b.out, b.sh_y, static_cast<size_t>(T) * L.h);
            });
            stage("layer, as the model runs it", [&](int i) { moe_int4_layer(ctx, L, b, xi(i), T, true); });
            stage("layer, shared expert separate", [&](int i) { moe_int4_layer(ctx, L, b, xi(i), T, true, true); });
            const auto layer = [&](int i) { moe_int4_layer(ctx, L, b, xi(i), T, true); };
            std::printf("    %-44s %7.1f us\n", "layer, 8 inputs in one graph (per layer)", one_graph_us(layer));
            std::printf("    %-44s %7.1f us\n", "layer, eager (8 calls back to back)", tm.per_call_us(ctx.stream, reps, n_inputs, layer));
            std::printf("    %-44s %7.1f us\n", "moe_ffn routed+shared, 8 in one graph", one_graph_us([&](int i) {
                moe_ffn(ctx, b.out, xi(i), b.idx, b.weight, T, L.k, ew);
            }));
            continue;
        }
        const double bytes = moe_byte_limit(ctx, L, b, xi, T, n_inputs);
        std::unique_ptr<LayerProbe> probe;
        if (g_moe_probe && T != 16) {
            probe = std::make_unique<LayerProbe>(ctx, T);
            // The per-layer graphs timed as the table times them (captured, not uploaded, 4 of the 8
            // launched once, the table's repetitions) but with an event after every graph, each
            // repetition printed: where the time of the first per-layer graphs of the run goes.
            // The table's own figure below then comes second.
            std::vector<cudaGraphExec_t> first(n_inputs);
            for (int i = 0; i < n_inputs; ++i)
                first[i] = probe->capture([&] { moe_int4_layer(ctx, L, b, xi(i), T, true); }, false);
            probe->run("first: graph a layer, as the table, pos", n_inputs, 1, false, true,
                       [&](int i) { KD_CUDA_CHECK(cudaGraphLaunch(first[i], ctx.stream)); }, reps, 4, true);
            for (auto& e : first) cudaGraphExecDestroy(e);
        }
        const double t_graph = graph_us([&](int i) { moe_int4_layer(ctx, L, b, xi(i), T, true); });
        const double pct = 100.0 * bytes / t_graph / 1e3 / ceiling;
        // The same layer as one of 8 in one graph (a forward's graph holds all its layers: no
        // graph-launch boundary between them); the headline ratio stays the one-graph-per-layer one.
        const double t_graph8 = one_graph_us([&](int i) { moe_int4_layer(ctx, L, b, xi(i), T, true); });
        const double t_separate = graph_us([&](int i) { moe_int4_layer(ctx, L, b, xi(i), T, true, true); });
        const double t_eager = tm.per_call_us(ctx.stream, reps, n_inputs, [&](int i) {
            moe_int4_layer(ctx, L, b, xi(i), T, true);
        });
        const double t_f32_grouped = tm.per_call_us(ctx.stream, reps, n_inputs, [&](int i) {
            moe_int4_layer(ctx, L, b, xi(i), T, false);
        });
        const double t_cublas = tm.per_call_us(ctx.stream, reps, n_inputs, [&](int i) {
            moe_fp32_cublas_layer(ctx, L, b, xi(i), T);
        });
        std::printf("  T=%-2d int4 graph %7.1f us (shared separate %7.1f, 8 layers a graph %7.1f) eager %7.1f us | fp32 cuBLAS %8.1f us"
                    " grouped %8.1f us | x%5.2f (separate x%5.2f, 8 a graph x%5.2f) vs cuBLAS, x%5.2f vs grouped | %5.1f%% of %.1f MB"
                    " at the ceiling | nmse int4 %.1e fp32 %.1e | out bits %016llx %s\n",
                    T, t_graph, t_separate, t_graph8, t_eager, t_cublas, t_f32_grouped, t_cublas / t_graph, t_cublas / t_separate,
                    t_cublas / t_graph8, t_f32_grouped / t_graph, pct, bytes / 1e6, err_q, err_f32,
                    static_cast<unsigned long long>(output_bits(q4)), ok ? "" : "FAILED");
        std::fflush(stdout);
        JsonOut j;
        j.num("tokens", T);
        j.num("int4_graph_us", t_graph); j.num("int4_separate_shared_graph_us", t_separate); j.num("int4_eager_us", t_eager);
        j.num("fp32_cublas_us", t_cublas); j.num("fp32_grouped_us", t_f32_grouped);
        j.num("speedup_int4_vs_fp32_cublas", t_cublas / t_graph);
        j.num("speedup_int4_separate_shared_vs_fp32_cublas", t_cublas / t_separate);
        j.num("int4_graph8_us", t_graph8); j.num("speedup_int4_graph8_vs_fp32_cublas", t_cublas / t_graph8);
        j.num("speedup_int4_vs_fp32_grouped", t_f32_grouped / t_graph);
        // The headline share is one graph per layer, as the issue measured it; a forward's graph
        // holds all its layers and pays the graph-launch boundary once (graph8).
        j.num("byte_limit_bytes", bytes); j.num("pct_ceiling", pct);
        j.num("pct_ceiling_graph8", 100.0 * bytes / t_graph8 / 1e3 / ceiling);
        j.num("nmse_int4_vs_fp32", err_q); j.raw("shared_stacked_equals_separate", same ? "true" : "false");
        j.num("nmse_fp32_grouped_vs_cublas", err_f32);
        char bits[20];
        std::snprintf(bits, sizeof bits, "%016llx", static_cast<unsigned long long>(output_bits(q4)));
        j.raw("int4_out_bits", std::string("\"") + bits + "\"");
        j.raw("valid", ok ? "true" : "false");
        rows << (first ? "" : ",\n    ") << j.obj();
        first = false;
        if (probe) {
            // The layer timed in other ways (PREPS repetitions each), after the table's figures.
            std::vector<cudaGraphExec_t> per(n_inputs), sep(n_inputs), empty(n_inputs);
            for (int i = 0; i < n_inputs; ++i) {
                per[i] = probe->capture([&] { moe_int4_layer(ctx, L, b, xi(i), T, true); });
                sep[i] = probe->capture([&] { moe_int4_layer(ctx, L, b, xi(i), T, true, true); });
                empty[i] = probe->capture([&] {
                    for (int k = 0; k < 7; ++k) empty_kernel<<<1, 32, 0, ctx.stream>>>();
                });
            }
            const cudaGraphExec_t all8 = probe->capture([&] {
                for (int i = 0; i < n_inputs; ++i) moe_int4_layer(ctx, L, b, xi(i), T, true);
            });
            const auto g = [&](std::vector<cudaGraphExec_t>& v) {
                return [&v, &ctx](int i) { KD_CUDA_CHECK(cudaGraphLaunch(v[i % v.size()], ctx.stream)); };
            };
            const auto one8 = [&](int) { KD_CUDA_CHECK(cudaGraphLaunch(all8, ctx.stream)); };
            const auto eager = [&](int i) { moe_int4_layer(ctx, L, b, xi(i), T, true); };
            LayerProbe& pr = *probe;
            pr.run("graph a layer, 8 a rep", 8, 1, false, false, g(per));
            pr.run("graph a layer, 8 a rep, pos", 8, 1, false, true, g(per));
            pr.run("graph a layer, 8 a rep, queued", 8, 1, true, false, g(per));
            pr.run("graph a layer, 8 a rep, queued, pos", 8, 1, true, true, g(per));
            pr.run("graph a layer, 64 a rep", 64, 1, false, false, g(per));
            pr.run("8 layers a graph", 1, n_inputs, false, false, one8);
            pr.run("8 layers a graph, queued", 1, n_inputs, true, false, one8);
            pr.run("eager, 8 a rep", 8, 1, false, false, eager);
            pr.run("eager, 8 a rep, queued", 8, 1, true, false, eager);
            pr.run("separate: graph a layer, 8 a rep", 8, 1, false, false, g(sep));
            pr.run("separate: graph a layer, queued", 8, 1, true, false, g(sep));
            pr.run("7 empty kernels: graph, 8 a rep", 8, 1, false, false, g(empty));
            pr.run("7 empty kernels: graph, queued", 8, 1, true, false, g(empty));
            std::printf("  probe T=%d %-36s us a layer %7.1f\n", T, "graph a layer as the table (again)",
                        graph_us([&](int i) { moe_int4_layer(ctx, L, b, xi(i), T, true); }));
            for (auto* v : {&per, &sep, &empty})
                for (auto& e : *v) cudaGraphExecDestroy(e);
            cudaGraphExecDestroy(all8);
        }
    }
    for (int j = 0; j < 3; ++j) {
        cudaFree(L.w[j]); cudaFree(L.q[j]); cudaFree(L.s[j]);
    }
    cudaFree(L.gate_w); cudaFree(L.gate_b); cudaFree(xin); cudaFree(out_ref);
    for (float* p : {b.logits, b.weight, b.out, b.sh_a, b.sh_b, b.sh_y, b.xs, b.ha, b.hb, b.ys}) cudaFree(p);
    cudaFree(b.idx); cudaFree(b.d_rows);
    return rows.str();
}

}  // namespace

int main(int argc, char** argv) {
    std::string json_path;
    bool quick = false;
    int only[3] = {0, 0, 0}, only_f32[3] = {0, 0, 0};
    int moe_T = 0;
    bool moe_only = false, moe_int4 = false;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--json" && i + 1 < argc) json_path = argv[++i];
        else if (a == "--quick") quick = true;
        else if (a == "--only" && i + 3 < argc) for (int& v : only) v = std::atoi(argv[++i]);
        else if (a == "--only-f32" && i + 3 < argc) for (int& v : only_f32) v = std::atoi(argv[++i]);
        else if ((a == "--moe" || a == "--moe-int4") && i + 1 < argc) {
            moe_T = std::atoi(argv[++i]);
            moe_int4 = a == "--moe-int4";
        }
        else if (a == "--moe-only") moe_only = true;
        else if (a == "--moe-probe") g_moe_probe = true;
        else {
            std::fprintf(stderr, "usage: bench_gpu [--json PATH] [--quick] [--only N K M] [--only-f32 N K M] [--moe T] [--moe-int4 T] [--moe-only] [--moe-probe]\n");
            return 2;
        }
    }
    try {
        Context ctx;
        KD_CUDA_CHECK(cudaStreamCreateWithFlags(&ctx.stream, cudaStreamNonBlocking));
        g_stream = ctx.stream;
        KD_CUDA_CHECK(cudaDeviceGetAttribute(&ctx.num_sms, cudaDevAttrMultiProcessorCount, 0));
        if (!cublas_init(ctx)) throw std::runtime_error("bench_gpu needs cuBLAS");
        ctx.use_cublas = true;
        cudaDeviceProp prop{};
        KD_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
        std::printf("device: %s, sm_%d%d, %d SMs, %zu MiB, L2 %d MiB\n", prop.name, prop.major, prop.minor,
                    prop.multiProcessorCount, prop.totalGlobalMem >> 20, prop.l2CacheSize >> 20);

        if (only[0] > 0) {  // one matmul_w4a16 shape and nothing else
            const int N = only[0], K = only[1], M = only[2];
            const size_t nw = static_cast<size_t>(N) * K;
            uint32_t* q = dev_alloc<uint32_t>(nw / 8);
            float* sc = dev_alloc<float>(nw / 32);
            float* x = dev_alloc<float>(static_cast<size_t>(M) * K);
            float* y = dev_alloc<float>(static_cast<size_t>(M) * N);
            fill_nibbles<<<kFillGrid, kFillBlock, 0, ctx.stream>>>(q, nw / 8, 1);
            fill_uniform<<<kFillGrid, kFillBlock, 0, ctx.stream>>>(sc, nw / 32, 2, 0.002f, 0.02f);
            const auto [tq, ts] = tiled(ctx, q, sc, N, K);
            fill_uniform<<<kFillGrid, kFillBlock, 0, ctx.stream>>>(x, static_cast<size_t>(M) * K, 3, -1.0f, 1.0f);
            Timer tm;  // one weight set: a first look, for the profiler; the table rotates copies
            const double us = tm.per_call_us(ctx.stream, 20, 1, [&](int) {
                matmul_w4a16(ctx, y, x, reinterpret_cast<const int32_t*>(tq), ts, M, N, K);
            });
            const uint64_t bits = output_bits(to_host(y, static_cast<size_t>(M) * N));
            std::printf("matmul_w4a16 %dx%d M=%d: %.2f us, %.0f GB/s (median of 20), output bits %016llx\n", N, K, M, us,
                        (nw * 0.625 + 4.0 * M * (static_cast<double>(K) + N)) / us / 1e3,
                        static_cast<unsigned long long>(bits));
            return 0;
        }
        if (only_f32[0] > 0) {  // one matmul_f32 shape, cuBLAS (16-row passes) and mm_core
            const int N = only_f32[0], K = only_f32[1], M = only_f32[2];
            const size_t nw = static_cast<size_t>(N) * K;
            float* w = dev_alloc<float>(nw);
            float* x = dev_alloc<float>(static_cast<size_t>(M) * K);
            float* y = dev_alloc<float>(static_cast<size_t>(M) * N);
            fill_uniform<<<kFillGrid, kFillBlock, 0, ctx.stream>>>(w, nw, 1, -0.05f, 0.05f);
            fill_uniform<<<kFillGrid, kFillBlock, 0, ctx.stream>>>(x, static_cast<size_t>(M) * K, 3, -1.0f, 1.0f);
            Timer tm;
            for (const bool cublas : {true, false}) {
                ctx.use_cublas = cublas;
                const double us = tm.per_call_us(ctx.stream, 20, 1, [&](int) {
                    matmul_f32(ctx, y, x, w, nullptr, M, N, K);
                });
                std::printf("matmul_f32 %s %dx%d M=%d: %.2f us, %.0f GB/s (median of 20)\n", cublas ? "cuBLAS" : "kernel", N,
                            K, M, us, (nw * 4.0 + 4.0 * M * (static_cast<double>(K) + N)) / us / 1e3);
            }
            return 0;
        }
        int failures = 0;
        if (moe_T > 0) {  // the MoE layer at one batch size and nothing else
            bench_moe(ctx, 0.0, true, failures, moe_T, moe_int4);
            return failures ? 1 : 0;
        }
        double copy_gbs = 0;
        const double ceiling = bench_ceiling(ctx, copy_gbs);
        std::printf("read-bandwidth ceiling (128-bit read-only kernel, 4 GiB): %.0f GB/s; D2D copy %.0f GB/s (read+write)\n",
                    ceiling, copy_gbs);
        if (ceiling < 4000) std::printf("WARNING: ceiling under 4 TB/s: the measurement is suspect\n");

        std::printf("w4a16 GEMM (v2 = backend matmul_w4a16, v1 = straightforward; %% of the ceiling)\n");
        std::string gemm;
        const int shapes[3][2] = {{2048, 7168}, {7168, 2048}, {28672, 8192}};
        // KD_BENCH_GEMM_SHAPES (say "2048x7168,28672x8192"): only those shapes in the table.
        const char* only_shapes = std::getenv("KD_BENCH_GEMM_SHAPES");
        for (const auto& sh : shapes) {
            if (moe_only) break;
            if (only_shapes && ("," + std::string(only_shapes) + ",").find("," + std::to_string(sh[0]) + "x" +
                                                                           std::to_string(sh[1]) + ",") == std::string::npos)
                continue;
            const std::string r = bench_gemm(ctx, sh[0], sh[1], ceiling, quick, failures);
            gemm += (gemm.empty() ? "" : ",\n    ") + r;
        }
        std::printf("K2 MoE layer (h 7168, 384 experts, top-8, inter 2048, 1 shared), time per token batch\n");
        const std::string moe = bench_moe(ctx, ceiling, quick, failures);

        if (!json_path.empty()) {
            std::ofstream out(json_path);
            out << "{\"version\": 1, \"device\": \"" << prop.name << "\", \"sm\": \"sm_" << prop.major << prop.minor
                << "\",\n \"ceiling\": {\"read_GBps\": " << ceiling << ", \"d2d_copy_GBps\": " << copy_gbs
                << ", \"method\": \"128-bit ld.global.nc read-only kernel over 4 GiB, median of 10\"},\n"
                << " \"w4a16_gemm\": [\n    " << gemm << "\n ],\n \"moe_k2_layer\": [\n    " << moe << "\n ],\n"
                << " \"failures\": " << failures << "}\n";
        }
        cublas_destroy(ctx);
        std::printf("%s\n", failures ? "BENCH VALIDATION FAILED" : "bench validation passed");
        return failures ? 1 : 0;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "bench_gpu: %s\n", e.what());
        return 1;
    }
}
