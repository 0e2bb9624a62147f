// moe_gate.cu: noaux_tc routing, a block per row and a thread per expert: sigmoid scores,
// optional group-limited masking, then the top_k in the order (score descending, index
// ascending; backend.h's ties) in two parallel steps: each warp sorts its 32 experts with
// shuffles and offers its first top_k, then each candidate counts the candidates ahead of it.
// (Scans by one thread or one warp run at one dependent instruction per ~10 cycles on one SM;
// a warp's repeated arg-max, a per-expert rank over all experts and a shared-memory bitonic
// sort each took 10-20 us at 384 experts.)
#include "ops.cuh"

namespace kd::cuda {

namespace {

constexpr int kGateMaxTopK = 32;  // a warp offers at most its 32 experts

// Whether entry a goes before entry b: higher value, then lower index.
__device__ __forceinline__ bool goes_before(float va, int ia, float vb, int ib) {
    return va > vb || (va == vb && ia < ib);
}

// Bitonic sort of the warp's 32 (v, i) by goes_before: lane l ends with the l-th.
__device__ __forceinline__ void warp_sort(float& v, int& i) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int k = 2; k <= 32; k <<= 1) {
#pragma unroll
        for (int j = k >> 1; j > 0; j >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, v, j);
            const int oi = __shfl_xor_sync(0xffffffffu, i, j);
            // In a run that ascends (lane & k == 0; the last run always), the lower lane of a
            // pair keeps the entry that goes before; in a descending run the other one.
            const bool keep_first = ((lane & j) == 0) == ((lane & k) == 0 || k == 32);
            if (goes_before(ov, oi, v, i) == keep_first) {
                v = ov;
                i = oi;
            }
        }
    }
}

__global__ void moe_gate_kernel(int32_t* idx, float* weight, const float* logits, const float* bias, int E,
                                int top_k, int n_groups, int topk_groups, float route_scale) {
    extern __shared__ float sm[];
    float* s = sm;                                        // [E] sigmoid scores
    float* sel = sm + E;                                  // [E] selection scores s + bias
    float* gscore = sel + E;                              // [n_groups]
    float* cand_v = gscore + n_groups;                    // [warps * top_k] candidates
    int* cand_i = reinterpret_cast<int*>(cand_v + (blockDim.x / 32) * top_k);
    int* chosen = cand_i + (blockDim.x / 32) * top_k;     // [top_k]
    const int m = blockIdx.x, e = threadIdx.x, lane = e & 31, warp = e >> 5;
    chain_acquire();
    chain_release();
    if (e < E) {
        s[e] = 1.0f / (1.0f + expf(-logits[static_cast<long>(m) * E + e]));
        sel[e] = s[e] + bias[e];
    }
    __syncthreads();
    if (n_groups > 1) {
        // A group's score: the sum of its two largest entries; the topk_groups best groups
        // (ties: the lower group) are kept, the others' experts masked.
        const int gs = E / n_groups;
        if (e < n_groups) {
            const float* v = sel + e * gs;
            int b1 = 0;
            for (int i = 1; i < gs; ++i)
                if (v[i] > v[b1]) b1 = i;
            float score = 0.0f + v[b1];
            if (gs > 1) {
                int b2 = b1 == 0 ? 1 : 0;
                for (int i = 0; i < gs; ++i)
                    if (i != b1 && v[i] > v[b2]) b2 = i;
                score += v[b2];
            }
            gscore[e] = score;
        }
        __syncthreads();
        bool kept = false;
        if (e < E) {
            const int g = e / gs;
            int ahead = 0;
            for (int h = 0; h < n_groups; ++h) ahead += goes_before(gscore[h], h, gscore[g], g);
            kept = ahead < topk_groups;
        }
        if (e < E && !kept) sel[e] = -INFINITY;
        __syncthreads();
    }
    // Each warp's first top_k (padding lanes go last: -inf and an index past every expert).
    float v = e < E ? sel[e] : -INFINITY;
    int i = e;
    warp_sort(v, i);
    const int n_cand = (blockDim.x / 32) * top_k;
    if (lane < top_k) {
        cand_v[warp * top_k + lane] = v;
        cand_i[warp * top_k + lane] = i;
    }
    __syncthreads();
    // A candidate's place among all candidates is its place among all experts (the experts
    // ahead of one of the top_k are all candidates).
    for (int c = e; c < n_cand; c += blockDim.x) {
        const float cv = cand_v[c];
        const int ci = cand_i[c];
        int ahead = 0;
        for (int d = 0; d < n_cand; ++d) ahead += goes_before(cand_v[d], cand_i[d], cv, ci);
        if (ahead < top_k) chosen[ahead] = ci;
    }
    __syncthreads();
    if (e == 0) {
        float total = 0.0f;
        for (int j = 0; j < top_k; ++j) total += s[chosen[j]];
        for (int j = 0; j < top_k; ++j) {
            idx[static_cast<long>(m) * top_k + j] = chosen[j];
            weight[static_cast<long>(m) * top_k + j] = s[chosen[j]] / total * route_scale;
        }
    }
}

}  // namespace

void moe_gate(Context& ctx, int32_t* idx, float* weight, const float* logits, const float* bias, int M,
              const MoeRouting& r) {
    if (M <= 0) return;
    if (r.n_experts <= 0 || r.n_groups <= 0 || r.n_experts % r.n_groups != 0 || r.top_k <= 0 ||
        r.top_k > r.n_experts || r.topk_groups <= 0 || r.topk_groups > r.n_groups)
        throw std::runtime_error("moe_gate: bad routing parameters (experts " + std::to_string(r.n_experts) +
                                 ", groups " + std::to_string(r.n_groups) + ", top_k " + std::to_string(r.top_k) + ")");
    if (r.n_experts > 1024 || r.top_k > kGateMaxTopK)
        throw std::runtime_error("moe_gate: " + std::to_string(r.n_experts) + " experts, top " + std::to_string(r.top_k) +
                                 ": at most 1024 experts (a thread each) and top 32");
    const int threads = ceil_div(r.n_experts, 32) * 32;
    const size_t smem = sizeof(float) * (2 * static_cast<size_t>(r.n_experts) + r.n_groups) +
                        (sizeof(float) + sizeof(int)) * (threads / 32) * r.top_k + sizeof(int) * r.top_k;
    launch_chained("moe_gate_kernel launch", moe_gate_kernel, dim3(M), dim3(threads), smem, ctx.stream, idx, weight,
                   logits, bias, r.n_experts, r.top_k, r.n_groups, r.topk_groups, r.route_scale);
}

}  // namespace kd::cuda
