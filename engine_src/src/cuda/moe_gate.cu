// moe_gate.cu: noaux_tc routing, one block per row: sigmoid scores, optional group-limited
// masking, then top_k by repeated block arg-max (ties to the lower index, as backend.h says).
#include "ops.cuh"

namespace kd::cuda {

namespace {

constexpr int kGateThreads = 128;

__global__ void moe_gate_kernel(int32_t* idx, float* weight, const float* logits, const float* bias, int E,
                                int top_k, int n_groups, int topk_groups, float route_scale) {
    extern __shared__ float sm[];
    float* s = sm;                                      // [E] sigmoid scores
    float* sel = sm + E;                                // [E] selection scores s + bias
    float* gscore = sm + 2 * E;                         // [n_groups]
    int* chosen = reinterpret_cast<int*>(sm + 2 * E + n_groups);  // [top_k]
    const int m = blockIdx.x;
    const float* l = logits + static_cast<long>(m) * E;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        s[e] = 1.0f / (1.0f + expf(-l[e]));
        sel[e] = s[e] + bias[e];
    }
    __syncthreads();
    if (n_groups > 1) {
        const int gs = E / n_groups;
        for (int g = threadIdx.x; g < n_groups; g += blockDim.x) {
            const float* v = sel + g * gs;
            int b1 = 0;
            for (int e = 1; e < gs; ++e)
                if (v[e] > v[b1]) b1 = e;
            float score = 0.0f + v[b1];
            if (gs > 1) {
                int b2 = b1 == 0 ? 1 : 0;
                for (int e = 0; e < gs; ++e)
                    if (e != b1 && v[e] > v[b2]) b2 = e;
                score += v[b2];
            }
            gscore[g] = score;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            // Keep the topk_groups best groups (ties: lower group); mark a kept group by
            // moving its score to +inf so the mask pass below can read it.
            for (int k = 0; k < topk_groups; ++k) {
                int best = -1;
                for (int g = 0; g < n_groups; ++g)
                    if (gscore[g] != INFINITY && (best < 0 || gscore[g] > gscore[best])) best = g;
                gscore[best] = INFINITY;
            }
        }
        __syncthreads();
        for (int e = threadIdx.x; e < E; e += blockDim.x)
            if (gscore[e / gs] != INFINITY) sel[e] = -INFINITY;
        __syncthreads();
    }
    // The j-th pick is the best entry strictly after the (j-1)-th in the order
    // (value descending, index ascending): no "taken" set needed.
    float pv = INFINITY;
    int pi = -1;
    for (int j = 0; j < top_k; ++j) {
        float v = -INFINITY;
        int i = 0x7fffffff;
        for (int e = threadIdx.x; e < E; e += blockDim.x) {
            const float x = sel[e];
            const bool after = x < pv || (x == pv && e > pi);
            if (after && (x > v || (x == v && e < i))) { v = x; i = e; }
        }
        block_argmax(v, i);
        pv = v;
        pi = i;
        if (threadIdx.x == 0) chosen[j] = i;
    }
    if (threadIdx.x == 0) {
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
    const size_t smem = sizeof(float) * (2 * static_cast<size_t>(r.n_experts) + r.n_groups) + sizeof(int) * r.top_k;
    if (smem > 48 * 1024) throw std::runtime_error("moe_gate: too many experts for one block");
    moe_gate_kernel<<<M, kGateThreads, smem, ctx.stream>>>(idx, weight, logits, bias, r.n_experts, r.top_k,
                                                           r.n_groups, r.topk_groups, r.route_scale);
    KD_CUDA_LAUNCH_CHECK("moe_gate_kernel");
}

}  // namespace kd::cuda
