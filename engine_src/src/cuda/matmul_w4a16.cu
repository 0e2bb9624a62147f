// matmul_w4a16.cu: y[M][N] = x[M][K] dequant(W)^T, INT4 weights with per-group fp32 scales
// (the kernel and its arithmetic are in w4a16_core.cuh).
#include "ops.cuh"
#include "w4a16_core.cuh"

namespace kd::cuda {

template void w4_run<false>(Context&, W4Params, int, int, int);
template void w4_run<true>(Context&, W4Params, int, int, int);

// Words and scales of an N x K INT4 matrix in the tiled layout (N padded to 8 rows, K to 256 inputs).
size_t w4a16_tiled_words(int N, int K) { return static_cast<size_t>(ceil_div(N, 8)) * 8 * ceil_div(K, 256) * 32; }
size_t w4a16_tiled_scales(int N, int K) { return static_cast<size_t>(ceil_div(N, 8)) * 8 * ceil_div(K, 256) * 8; }

namespace {

// The bundle's layout (qw [N][K/8], sc [N][K/32]) into the tiled one w4_kernel reads, one thread
// per tiled uint4 i = ((h * steps + s) * 2 + j) * 32 + lane (h: 8 rows, s: a step of 8 groups,
// lane = 4g + t): word w of it is word t of group 8s + 4j + w of row 8h + g (its nibbles in
// w4_word_order); for j = 0 the same
// thread writes float2 (h * steps + s) * 32 + lane: the scales of groups 8s + 2t, 8s + 2t + 1 of
// that row. Padding (rows >= N, groups >= K / 32) is zero.
__global__ void w4a16_tile_kernel(uint4* q_out, float2* s_out, const uint32_t* qw, const float* sc, int N, int K) {
    const int steps = (K + 255) / 256, groups = K / 32;
    const long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x;
    if (i >= static_cast<long>((N + 7) / 8) * steps * 64) return;
    const int lane = static_cast<int>(i % 32), j = static_cast<int>(i / 32 % 2);
    const long hs = i / 64;
    const int s = static_cast<int>(hs % steps), n = static_cast<int>(hs / steps) * 8 + lane / 4, t = lane % 4;
    const auto word = [&](int G) {
        return n < N && G < groups ? w4_word_order(qw[static_cast<long>(n) * (K / 8) + 4 * G + t]) : 0u;
    };
    const auto scale = [&](int G) { return n < N && G < groups ? sc[static_cast<long>(n) * groups + G] : 0.0f; };
    const int G = 8 * s + 4 * j;
    q_out[i] = make_uint4(word(G), word(G + 1), word(G + 2), word(G + 3));
    if (j == 0) s_out[hs * 32 + lane] = make_float2(scale(8 * s + 2 * t), scale(8 * s + 2 * t + 1));
}

}  // namespace

void w4a16_tile(Context& ctx, uint32_t* q_out, float* s_out, const uint32_t* qw, const float* sc, int N, int K) {
    const long n = static_cast<long>(ceil_div(N, 8)) * ceil_div(K, 256) * 64;
    w4a16_tile_kernel<<<ceil_div(n, 256), 256, 0, ctx.stream>>>(reinterpret_cast<uint4*>(q_out),
                                                                reinterpret_cast<float2*>(s_out), qw, sc, N, K);
    KD_CUDA_LAUNCH_CHECK("w4a16_tile_kernel");
}

void matmul_w4a16(Context& ctx, float* y, const float* x, const int32_t* qw, const float* sc, int M, int N, int K) {
    if (M <= 0 || N <= 0) return;
    if (K <= 0 || K % 32 != 0)
        throw std::runtime_error("matmul_w4a16: K = " + std::to_string(K) + " is not a positive multiple of 32");
    if (reinterpret_cast<uintptr_t>(qw) % 16 != 0 || reinterpret_cast<uintptr_t>(sc) % 8 != 0)
        throw std::runtime_error("matmul_w4a16: tiled weights (scales) are not 16 (8)-byte aligned");
    W4Params p;
    p.q = reinterpret_cast<const uint32_t*>(qw);
    p.s = sc;
    p.N = N;
    p.K = K;
    // Launches of up to KD_W4_MAX_ROWS rows (a row's result does not depend on its launch).
    for (int m0 = 0; m0 < M; m0 += KD_W4_MAX_ROWS) {
        p.M = std::min(KD_W4_MAX_ROWS, M - m0);
        p.x = x + static_cast<long>(m0) * K;
        p.ldx = K;
        p.y = y + static_cast<long>(m0) * N;
        p.ldy = N;
        w4_run<false>(ctx, p, p.M, p.M, 1);
    }
}

}  // namespace kd::cuda
