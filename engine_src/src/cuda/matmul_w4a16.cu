// matmul_w4a16.cu: y[M][N] = x[M][K] dequant(W)^T, INT4 weights with per-group fp32 scales
// (the kernel and its arithmetic are in mm_core.cuh).
#include "mm_core.cuh"
#include "ops.cuh"

namespace kd::cuda {

void matmul_w4a16(Context& ctx, float* y, const float* x, const int32_t* qw, const float* sc, int M, int N, int K) {
    if (M <= 0 || N <= 0) return;
    if (K <= 0 || K % 32 != 0)
        throw std::runtime_error("matmul_w4a16: K = " + std::to_string(K) + " is not a positive multiple of 32");
    if (reinterpret_cast<uintptr_t>(qw) % 16 != 0)
        throw std::runtime_error("matmul_w4a16: packed weights are not 16-byte aligned");
    MmParams p;
    p.a.q = reinterpret_cast<const uint32_t*>(qw);
    p.a.s = sc;
    mm_run_plain<WFmt::W4>(ctx, p, y, x, M, N, K);
}

}  // namespace kd::cuda
