// mla_attention.cu: absorbed MLA attention over the latent cache with the ancestor-only mask.
// One block per (row, head):
//   qa = W_UK^T q_nope (a thread per latent channel, j ascending);
//   s_t = scale (qa . c_t + q_rope . k_rope_t) for the visible rows only (a warp per row t;
//   masked rows are skipped, never added as -inf);
//   p = softmax(s): max, then exp, then the sum in ascending visible order by one thread;
//   u = sum_t p_t c_t (a thread per channel, t ascending); out = W_UV u (a warp per output).
// Every step depends only on the row's own visible list, so a node verified inside a tree gives
// the same values as the same token decoded after compaction.
#include "ops.cuh"

#include <algorithm>

namespace kd::cuda {

namespace {

constexpr int kAttnThreads = 128;
constexpr size_t kAttnMaxSmem = 200 * 1024;  // at most; less where the device allows less per block


__global__ void mla_attention_kernel(float* out, const float* q, const float* wkv_b, const float* cache,
                                     const int32_t* committed_dev, const int32_t* parent, int H, int d_c, int d_n, int d_r,
                                     int d_v, float scale) {
    chain_acquire();
    chain_release();
    const int committed = *committed_dev;  // a device value, so that a recorded launch stays valid
    extern __shared__ float sm[];
    const int m = blockIdx.x / H, h = blockIdx.x % H;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    float* qa = sm;                 // [d_c]
    float* qr = qa + d_c;           // [d_r]
    float* u = qr + d_r;            // [d_c]
    int* chain = reinterpret_cast<int*>(u + d_c);  // [m + 1] batch rows visible to row m
    float* sc = reinterpret_cast<float*>(chain + m + 1);  // [committed + m + 1]
    __shared__ int n_chain;
    __shared__ float inv_total;

    if (threadIdx.x == 0) {
        // Ancestors, deepest first, then reversed to ascending cache order.
        int n = 0;
        for (int a = m; a >= 0; a = parent[a]) chain[n++] = a;
        for (int i = 0; i < n / 2; ++i) {
            const int t = chain[i];
            chain[i] = chain[n - 1 - i];
            chain[n - 1 - i] = t;
        }
        n_chain = n;
    }
    const int row_width = d_c + d_r;
    const float* qm = q + (static_cast<long>(m) * H + h) * (d_n + d_r);
    const float* w_uk = wkv_b + static_cast<long>(h) * (d_n + d_v) * d_c;
    const float* w_uv = w_uk + static_cast<long>(d_n) * d_c;
    for (int c = threadIdx.x; c < d_c; c += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < d_n; ++j) acc += w_uk[static_cast<long>(j) * d_c + c] * qm[j];
        qa[c] = acc;
    }
    for (int i = threadIdx.x; i < d_r; i += blockDim.x) qr[i] = qm[d_n + i];
    __syncthreads();

    const int n_vis = committed + n_chain;
    for (int t = warp; t < n_vis; t += nw) {
        const int row = t < committed ? t : committed + chain[t - committed];
        const float* kv = cache + static_cast<long>(row) * row_width;
        float a = 0.0f, b = 0.0f;
        for (int c = lane; c < d_c; c += 32) a += qa[c] * kv[c];
        for (int i = lane; i < d_r; i += 32) b += qr[i] * kv[d_c + i];
        a = warp_sum(a);
        b = warp_sum(b);
        if (lane == 0) sc[t] = scale * (a + b);
    }
    __syncthreads();
    float mx = -INFINITY;
    for (int t = threadIdx.x; t < n_vis; t += blockDim.x) mx = fmaxf(mx, sc[t]);
    mx = block_max(mx);
    for (int t = threadIdx.x; t < n_vis; t += blockDim.x) sc[t] = expf(sc[t] - mx);
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.0f;
        for (int t = 0; t < n_vis; ++t) total += sc[t];
        inv_total = total;
    }
    __syncthreads();
    const float total = inv_total;
    for (int c = threadIdx.x; c < d_c; c += blockDim.x) {
        float acc = 0.0f;
        for (int t = 0; t < n_vis; ++t) {
            const int row = t < committed ? t : committed + chain[t - committed];
            acc += (sc[t] / total) * cache[static_cast<long>(row) * row_width + c];
        }
        u[c] = acc;
    }
    __syncthreads();
    float* o = out + static_cast<long>(m) * H * d_v + static_cast<long>(h) * d_v;
    for (int v = warp; v < d_v; v += nw) {
        const float* wr = w_uv + static_cast<long>(v) * d_c;
        float acc = 0.0f;
        for (int c = lane; c < d_c; c += 32) acc += wr[c] * u[c];
        acc = warp_sum(acc);
        if (lane == 0) o[v] = acc;
    }
}

// The kernel's dynamic shared memory limit on this device, set once: kAttnMaxSmem, or the
// device's opt-in maximum per block where that is smaller (sm_120: 99 KiB).
size_t attn_smem_limit() {
    static const size_t limit = [] {
        const size_t l = std::min(kAttnMaxSmem, static_cast<size_t>(device_smem_optin()));
        KD_CUDA_CHECK(cudaFuncSetAttribute(mla_attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(l)));
        return l;
    }();
    return limit;
}

}  // namespace

void mla_attention(Context& ctx, float* out, const float* q, const float* wkv_b, const float* cache,
                   const int32_t* committed, const int32_t* parent, int M, int max_rows, const MlaDims& d) {
    if (M <= 0) return;
    // Row m's chain (m + 1 ints) and scores (committed + m + 1 floats) fit in max_rows + 1 of each.
    const size_t smem = sizeof(float) * (2 * static_cast<size_t>(d.d_c) + d.d_r) + sizeof(int) * (M + 1) +
                        sizeof(float) * (static_cast<size_t>(max_rows) + 1);
    if (smem > attn_smem_limit())
        throw std::runtime_error("mla_attention: " + std::to_string(max_rows) +
                                 " visible rows exceed the kernel's shared memory (" +
                                 std::to_string(attn_smem_limit()) + " bytes on this device)");
    launch_op("mla_attention_kernel launch", mla_attention_kernel, dim3(M * d.n_heads), dim3(kAttnThreads), smem,
              ctx.stream, out, q, wkv_b, cache, committed, parent, d.n_heads, d.d_c, d.d_n, d.d_r, d.d_v, d.scale);
}

}  // namespace kd::cuda
