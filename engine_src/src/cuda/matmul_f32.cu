// matmul_f32.cu: y[M][N] = x[M][K] W[N][K]^T (+ bias), fp32 end to end (no TF32).
// cuBLAS SGEMM where the cuBLAS headers exist at build time and ctx.use_cublas is set, for
// outputs wider than kKernelMaxN with at least kCublasMinWeights weights; our mm_core.cuh kernel
// otherwise. cuBLAS picks its algorithm by shape, so to keep a row's result independent of M
// (backend.h) it is always called on passes of exactly 16 rows: a short last pass goes through a zero-padded copy. Narrow outputs
// (MoE routers: 256-384 experts) stay on our kernel: there a 16-row pass runs on a dozen 32x32
// tiles in two cuBLAS kernels (H200, 384 x 7168 in a CUDA graph: 22.8 us at one row, against
// 10.7 us for the kernel's split-K), and so do small wide ones (the drafter). The choice depends on
// the shape only, not on M.
#include "mm_core.cuh"
#include "ops.cuh"

#if __has_include(<cublas_v2.h>)
#include <cublas_v2.h>
#define KD_HAVE_CUBLAS 1
#endif

namespace kd::cuda {

template void mm_launch<false>(MmParams, int, int, int, cudaStream_t);
template void mm_launch<true>(MmParams, int, int, int, cudaStream_t);

namespace {

#ifdef KD_HAVE_CUBLAS
__global__ void add_bias_kernel(float* y, const float* bias, int M, int N) {
    chain_acquire();
    chain_release();
    const long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x;
    if (i < static_cast<long>(M) * N) y[i] += bias[i % N];
}

constexpr int kPassRows = 16;
constexpr int kKernelMaxN = 1024;
// Wide outputs with fewer weights than this stay on our kernel too (issue 21, fifth pass): the
// drafter, 3200 x 384 on the tiny bundles, took a padded 16-row cuBLAS pass (two copies, two
// cuBLAS kernels and the bias kernel, 13 us of a round's GPU time) where mm_kernel needs one launch.
constexpr long kCublasMinWeights = 1L << 22;
constexpr size_t kCublasWorkspace = 32u << 20;

void cublas_check(cublasStatus_t st, const char* what) {
    if (st != CUBLAS_STATUS_SUCCESS)
        throw std::runtime_error(std::string("cuda: ") + what + " failed: cuBLAS status " + std::to_string(st));
}

void matmul_cublas(Context& ctx, float* y, const float* x, const float* W, const float* bias, int M, int N, int K) {
    auto handle = static_cast<cublasHandle_t>(ctx.cublas);
    const float one = 1.0f, zero = 0.0f;
    for (int m0 = 0; m0 < M; m0 += kPassRows) {
        const int rows = std::min(kPassRows, M - m0);
        const float* xp = x + static_cast<long>(m0) * K;
        float* yp = y + static_cast<long>(m0) * N;
        if (rows < kPassRows) {
            float* xs = ctx.cublas_x.get<float>(static_cast<size_t>(kPassRows) * K);
            count_copy(cudaMemcpyDeviceToDevice);
            KD_CUDA_CHECK(cudaMemcpyAsync(xs, xp, sizeof(float) * rows * K, cudaMemcpyDeviceToDevice, ctx.stream));
            xp = xs;
            yp = ctx.cublas_y.get<float>(static_cast<size_t>(kPassRows) * N);
        }
        // Column-major view: y^T [N][16] = W^T^T ... i.e. C(N x 16) = op(W)(N x K) * x^T(K x 16).
        count_launch();  // counted as one, whatever cuBLAS launches inside
        cublas_check(cublasSgemm(handle, CUBLAS_OP_T, CUBLAS_OP_N, N, kPassRows, K, &one, W, K, xp, K, &zero, yp, N),
                     "cublasSgemm");
        if (rows < kPassRows) {
            count_copy(cudaMemcpyDeviceToDevice);
            KD_CUDA_CHECK(cudaMemcpyAsync(y + static_cast<long>(m0) * N, yp, sizeof(float) * rows * N,
                                          cudaMemcpyDeviceToDevice, ctx.stream));
        }
    }
    if (bias) {
        const long n = static_cast<long>(M) * N;
        launch_op("add_bias_kernel launch", add_bias_kernel, dim3(ceil_div(n, 256)), dim3(256), 0, ctx.stream, y, bias, M,
                  N);
    }
}
#endif

}  // namespace

bool cublas_init(Context& ctx) {
#ifdef KD_HAVE_CUBLAS
    cublasHandle_t handle;
    cublas_check(cublasCreate(&handle), "cublasCreate");
    cublas_check(cublasSetStream(handle, ctx.stream), "cublasSetStream");
    // Default math is full fp32 for SGEMM; never the TF32 tensor-op mode.
    cublas_check(cublasSetMathMode(handle, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
    // Our own workspace: no allocation inside a CUDA graph capture.
    void* ws = nullptr;
    KD_CUDA_CHECK(cudaMalloc(&ws, kCublasWorkspace));
    cublas_check(cublasSetWorkspace(handle, ws, kCublasWorkspace), "cublasSetWorkspace");
    ctx.cublas = handle;
    ctx.cublas_workspace = ws;
    return true;
#else
    (void)ctx;
    return false;
#endif
}

void cublas_destroy(Context& ctx) {
#ifdef KD_HAVE_CUBLAS
    if (ctx.cublas) cublasDestroy(static_cast<cublasHandle_t>(ctx.cublas));
    if (ctx.cublas_workspace) cudaFree(ctx.cublas_workspace);
#endif
    ctx.cublas = nullptr;
    ctx.cublas_workspace = nullptr;
}

void matmul_f32_kernel(Context& ctx, float* y, const float* x, const float* W, const float* bias, int M, int N,
                       int K) {
    if (M <= 0 || N <= 0) return;
    MmParams p;
    p.a.w = W;
    p.bias = bias;
    p.weights_early = true;  // W is a weight (see ops.cuh)
    mm_run_plain(ctx, p, y, x, M, N, K);
}

void matmul_f32(Context& ctx, float* y, const float* x, const float* W, const float* bias, int M, int N, int K) {
    if (M <= 0 || N <= 0) return;
#ifdef KD_HAVE_CUBLAS
    if (ctx.use_cublas && ctx.cublas && N > kKernelMaxN && static_cast<long>(N) * K >= kCublasMinWeights) {
        matmul_cublas(ctx, y, x, W, bias, M, N, K);
        return;
    }
#endif
    matmul_f32_kernel(ctx, y, x, W, bias, M, N, K);
}

}  // namespace kd::cuda
