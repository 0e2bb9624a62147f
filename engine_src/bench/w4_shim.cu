// w4_shim.cu: the backend's matmul_w4a16 behind a C interface, so that bench/torch_ref.py times
// it in the same process, on the same stream and interleaved with PyTorch's kernels
// (scripts/bench_gpu.sh builds it as build/libkd_w4.so). Every function returns 0 on success,
// else 1 with kd_w4_error() saying why.
#include "../src/cuda/ops.cuh"
#include "../src/cuda/w4a16_core.cuh"

#include <memory>
#include <string>

using namespace kd::cuda;

namespace {

std::unique_ptr<Context> g_ctx;
std::string g_error;

// Runs fn, turning an exception into the error text.
template <class F>
int guarded(F&& fn) {
    try {
        if (!g_ctx) throw std::runtime_error("kd_w4_init was not called");
        fn(*g_ctx);
        return 0;
    } catch (const std::exception& e) {
        g_error = e.what();
        return 1;
    }
}

}  // namespace

extern "C" {

// Binds the backend's context to `stream` (a cudaStream_t: PyTorch's current stream) on the current device.
int kd_w4_init(void* stream) {
    try {
        g_ctx = std::make_unique<Context>();
        g_ctx->stream = static_cast<cudaStream_t>(stream);
        int device = 0;
        KD_CUDA_CHECK(cudaGetDevice(&device));
        KD_CUDA_CHECK(cudaDeviceGetAttribute(&g_ctx->num_sms, cudaDevAttrMultiProcessorCount, device));
        return 0;
    } catch (const std::exception& e) {
        g_error = e.what();
        return 1;
    }
}

const char* kd_w4_error() { return g_error.c_str(); }

// Words (uint32) and scales (float) of the tiled layout of an N x K matrix.
size_t kd_w4_tiled_words(int N, int K) { return w4a16_tiled_words(N, K); }
size_t kd_w4_tiled_scales(int N, int K) { return w4a16_tiled_scales(N, K); }

// upload_w4a16's tiling: the bundle's layout (qw [N][K/8], sc [N][K/32], device) into q_out, s_out.
int kd_w4_tile(uint32_t* q_out, float* s_out, const uint32_t* qw, const float* sc, int N, int K) {
    return guarded([&](Context& ctx) { w4a16_tile(ctx, q_out, s_out, qw, sc, N, K); });
}

// matmul_w4a16: y[M][N] = x[M][K] W^T (fp32 x and y, W tiled), queued on the bound stream.
int kd_w4_matmul(float* y, const float* x, const uint32_t* tq, const float* ts, int M, int N, int K) {
    return guarded([&](Context& ctx) { matmul_w4a16(ctx, y, x, reinterpret_cast<const int32_t*>(tq), ts, M, N, K); });
}

// Forces the super-chunk length (256, 512, 1024) for the calls that follow; 0: the default (w4_schunk).
int kd_w4_set_schunk(int sc_len) {
    if (sc_len != 0 && sc_len != 256 && sc_len != 512 && sc_len != 1024) {
        g_error = "kd_w4_set_schunk: " + std::to_string(sc_len) + " is not 0, 256, 512 or 1024";
        return 1;
    }
    w4_schunk_override() = sc_len;
    return 0;
}

// The super-chunk length the next call takes.
int kd_w4_schunk() { return w4_schunk(); }

}  // extern "C"
