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

// lists (a grid of one row only): moe_ffn's routing lists for the row's pairs, the chosen
// experts j < top_k and then, where lists.n_pairs says so, the shared set (lists.n_sets - 1).
// The gate's experts are distinct and the shared set is none of them, so every pair is a slot of
// its own, the slots in ascending expert order: what moe_lists_kernel makes of one row's pairs.
__global__ void moe_gate_kernel(int32_t* idx, float* weight, const float* logits, const float* bias, int E,
                                int top_k, int n_groups, int topk_groups, float route_scale, MoeLists lists) {
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
    if (lists.pair_id) {
        const auto expert = [&](int i) { return i < top_k ? chosen[i] : lists.n_sets - 1; };
        for (int i = e; i < lists.n_pairs; i += blockDim.x) {
            const int ex = expert(i);
            int pos = 0;
            for (int d = 0; d < lists.n_pairs; ++d) pos += expert(d) < ex;
            lists.slot_expert[pos] = ex;
            lists.slot_start[pos] = pos;
            lists.pair_token[pos] = 0;
            lists.pair_id[pos] = i;
        }
        if (e == 0) {
            *lists.n_active = lists.n_pairs;
            lists.slot_start[lists.n_pairs] = lists.n_pairs;
        }
    }
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
              const MoeRouting& r, const MoeLists* lists) {
    if (M <= 0) return;
    // The lists of one row: its top_k pairs over the routed sets, or one more pair and set (the shared one).
    const int extra = lists ? lists->n_pairs - r.top_k : 0;
    if (lists && (M != 1 || extra < 0 || extra > 1 || lists->n_sets != r.n_experts + extra))
        throw std::runtime_error("moe_gate: routing lists of " + std::to_string(lists->n_pairs) + " pairs over " +
                                 std::to_string(lists->n_sets) + " expert sets for " + std::to_string(M) +
                                 " rows of top " + std::to_string(r.top_k) + " of " + std::to_string(r.n_experts) +
                                 " (one row: top_k pairs over the experts, or one more of each for the shared set)");
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
                   logits, bias, r.n_experts, r.top_k, r.n_groups, r.topk_groups, r.route_scale,
                   lists ? *lists : MoeLists{});
}

}  // namespace kd::cuda
