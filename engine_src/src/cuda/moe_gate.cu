// moe_gate.cu: noaux_tc routing, one warp per row: sigmoid scores, optional group-limited
// masking, then top_k by repeated warp arg-max (ties to the lower index, as backend.h says).
// A warp needs no block barriers, which keeps this small op at a few microseconds.
#include "ops.cuh"

namespace kd::cuda {

namespace {


__global__ void moe_gate_kernel(int32_t* idx, float* weight, const float* logits, const float* bias, int E,
                                int top_k, int n_groups, int topk_groups, float route_scale) {
    extern __shared__ float sm[];
    float* s = sm;                                      // [E] sigmoid scores
    float* sel = sm + E;                                // [E] selection scores s + bias
    float* gscore = sm + 2 * E;                         // [n_groups]
    int* chosen = reinterpret_cast<int*>(sm + 2 * E + n_groups);  // [top_k]
    const int m = blockIdx.x;
    const float* l = logits + static_cast<long>(m) * E;
    const int lane = threadIdx.x;
    for (int e = lane; e < E; e += 32) {
        s[e] = 1.0f / (1.0f + expf(-l[e]));
        sel[e] = s[e] + bias[e];
    }
    __syncwarp();
    if (n_groups > 1) {
        const int gs = E / n_groups;
        for (int g = lane; g < n_groups; g += 32) {
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
        __syncwarp();
        if (lane == 0) {
            // Keep the topk_groups best groups (ties: lower group); mark a kept group by
            // moving its score to +inf so the mask pass below can read it.
            for (int k = 0; k < topk_groups; ++k) {
                int best = -1;
                for (int g = 0; g < n_groups; ++g)
                    if (gscore[g] != INFINITY && (best < 0 || gscore[g] > gscore[best])) best = g;
                gscore[best] = INFINITY;
            }
        }
        __syncwarp();
        for (int e = lane; e < E; e += 32)
            if (gscore[e / gs] != INFINITY) sel[e] = -INFINITY;
        __syncwarp();
    }
    // The j-th pick is the best entry strictly after the (j-1)-th in the order
    // (value descending, index ascending): no "taken" set needed.
    float pv = INFINITY;
    int pi = -1;
    for (int j = 0; j < top_k; ++j) {
        float v = -INFINITY;
        int i = 0x7fffffff;
        for (int e = lane; e < E; e += 32) {
            const float x = sel[e];
            const bool after = x < pv || (x == pv && e > pi);
            if (after && (x > v || (x == v && e < i))) { v = x; i = e; }
        }
        warp_argmax(v, i);
        pv = v;
        pi = i;
        if (lane == 0) chosen[j] = i;
    }
    __syncwarp();
    if (lane == 0) {
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
    moe_gate_kernel<<<M, 32, smem, ctx.stream>>>(idx, weight, logits, bias, r.n_experts, r.top_k,
                                                           r.n_groups, r.topk_groups, r.route_scale);
    KD_CUDA_LAUNCH_CHECK("moe_gate_kernel");
}

}  // namespace kd::cuda
