// mm_core.cuh: the fp32 matmul kernel behind matmul_f32's own path (narrow outputs, or no
// cuBLAS) and the grouped fp32 expert FFN of moe_ffn: y[m][n] = sum_k x[m][k] W[n][k], weights
// fp32 [N][K], activations and accumulation in fp32.
//
// Shape of the work
//   * A block is 8 warps; a warp owns R weight rows (R/2 output rows with the fused SwiGLU
//     epilogue, whose rows come in (w1, w3) pairs) and streams them along K.
//   * A lane reads 4 strided words per step (a warp step covers 128 inputs, coalesced); each
//     weight is loaded once and reused across the MT activation rows.
//   * Activations for MT rows and a chunk of K sit in shared memory.
//   * Dynamic mode (all of K for all rows of the pass fits one staged chunk): one resident wave
//     of blocks stages the activations once; warps take units of R rows from a device counter
//     (no block-level tail), asking for the next unit when they start one and reading the answer
//     only when they need it; units of one or two steps are dealt round-robin instead (the
//     counter's round trip would not hide behind them). A warp keeps the next step's weights
//     loading in a second register buffer.
//     Static mode otherwise: a block owns a balanced set of row blocks, streamed per K chunk.
//   * Split-K (plain matmuls whose grid would not fill the GPU): one block per super-chunk.
//
// The arithmetic of one output (the DDTree == AR invariant of backend.h)
//   K is cut into super-chunks of KD_MM_SCHUNK inputs. Inside one, lane l accumulates its inputs
//   in ascending order; at the end of the super-chunk the 32 lane sums are added by an xor
//   butterfly (identical on every lane) and the result is added to the row total, super-chunks
//   in ascending order. With split-K, each super-chunk's value goes to a workspace and the last
//   block adds them in the same ascending order from zero. Nothing depends on M, on which token
//   slot a row occupies, on R, on the split choice or on grouping: matmul_f32's kernel path,
//   moe_ffn's fp32 experts and split or not give bit-identical rows.
#pragma once

#include "common.cuh"
#include "context.cuh"

#include <algorithm>
#include <type_traits>
#include <utility>

namespace kd::cuda {

constexpr int KD_MM_WARPS = 8;
constexpr int KD_MM_THREADS = 32 * KD_MM_WARPS;
constexpr int KD_MM_SCHUNK = 2048;       // inputs per super-chunk (a multiple of the warp step)
constexpr int KD_MM_SMEM_FLOATS = 16384; // activation staging budget (64 KiB)
constexpr int KD_MM_MAX_RB = 8;         // row blocks one block may own (their totals sit in shared memory)
constexpr int KD_MM_MAX_PASS = 8;       // activation rows per pass (more rows: more passes)

struct MmWeights {
    const float* w = nullptr;  // [N][K]
};

struct MmParams {
    MmWeights a, b;               // b: the w3 of the fused SwiGLU epilogue (silu(a x) * (b x))
    long w_estride = 0;           // grouped: elements between experts
    const float* x = nullptr;
    long ldx = 0;
    float* y = nullptr;
    long ldy = 0;
    const float* bias = nullptr;  // [N] or null
    int M = 0, N = 0, K = 0;
    int kch = 0;                  // staged K chunk (multiple of KD_MM_SCHUNK)
    // Grouped mode (slot_expert != null): blockIdx.y is a slot; its rows are
    // [slot_start[slot], slot_start[slot + 1]) of a sorted (expert, token) pair list.
    const int* slot_expert = nullptr;
    const int* slot_start = nullptr;
    const int* n_active = nullptr;
    const int* row_in = nullptr;  // x row of pair p (null: p)
    const int* row_out = nullptr; // y row of pair p (null: p)
    // Split-K (splits > 1, plain mode only): blockIdx.y is the super-chunk.
    int splits = 1;
    float* ws = nullptr;          // [splits][M][N]
    unsigned* counters = nullptr; // [row blocks]: blocks done per row block, zero between launches
    // Dynamic scheduling: two counters per slot (next unit, blocks done), zero between launches.
    unsigned* sched = nullptr;
    // Plain mode: the weights are constants that nothing queued on the stream writes while a
    // decode runs (a model's matrices; matmul_f32_kernel sets it), so a one-chunk (dynamic mode)
    // launch may issue its first weight loads before chain_acquire.
    bool weights_early = false;
};

// Weight rows a warp streams together: more rows, more bytes in flight; fewer, fewer registers.
__host__ __device__ constexpr int mm_rows_per_warp(int mt) { return mt <= 2 ? 4 : 2; }

// Inputs per warp step: 32 lanes x 4 strided words.
__host__ __device__ constexpr int mm_warp_step() { return 128; }

// Staged K chunk for MT activation rows and a K range of klen inputs: a multiple of the
// super-chunk (so a super-chunk never spans two chunks), as much of K as the budget holds.
inline int mm_stage_chunk(int mt, int klen) {
    // One super-chunk or less: one chunk of what K needs (a multiple of 32 floats), not a whole
    // super-chunk per row (8-row passes of the tiny models asked for 64 KiB to stage 6 KiB).
    if (klen <= KD_MM_SCHUNK) return (klen + 31) / 32 * 32;
    const int budget = KD_MM_SMEM_FLOATS / mt / KD_MM_SCHUNK * KD_MM_SCHUNK;
    const int need = (klen + KD_MM_SCHUNK - 1) / KD_MM_SCHUNK * KD_MM_SCHUNK;
    return std::min(budget, need);
}

// One warp step of weights for R rows (see mm_kernel).
template <int R>
struct WStep {
    float w[R][4];
};

template <int R>
__device__ __forceinline__ void load_step(WStep<R>& st, const float* const* wrow, int k, int ke, int lane) {
#pragma unroll
    for (int u = 0; u < 4; ++u) {
        const int kk = k + lane + 32 * u;
#pragma unroll
        for (int r = 0; r < R; ++r) st.w[r][u] = kk < ke ? __ldg(wrow[r] + kk) : 0.0f;
    }
}

// One warp step: adds this lane's share of the step's inputs, 4 strided ones, into part (see
// mm_kernel for the order). FULL: the step lies wholly inside K (no lane is past its end).
template <int MT, int R, bool FULL = false>
__device__ __forceinline__ void mm_step(float (&part)[R][MT], const WStep<R>& cur, const float* xs, int kch, int k,
                                        int kc, int ke, int mc, int lane) {
#pragma unroll
    for (int u = 0; u < 4; ++u) {
        const int kk = k + lane + 32 * u;
        if (FULL || kk < ke) {
#pragma unroll
            for (int m = 0; m < MT; ++m)
                if (m == 0 || m < mc) {
                    const float xv = xs[m * kch + (kk - kc)];
#pragma unroll
                    for (int r = 0; r < R; ++r) part[r][m] = fmaf(cur.w[r][u], xv, part[r][m]);
                }
        }
    }
}

// mm_step, then at the end of a super-chunk the butterfly of the lane sums into tot.
template <int MT, int R, bool FULL>
__device__ __forceinline__ void mm_step_reduce(float (&part)[R][MT], float (&tot)[R][MT], const WStep<R>& cur,
                                               const float* xs, int kch, int k, int kc, int ke, int mc, int lane) {
    mm_step<MT, R, FULL>(part, cur, xs, kch, k, kc, ke, mc, lane);
    if ((k + mm_warp_step()) % KD_MM_SCHUNK == 0 || k + mm_warp_step() >= ke) {
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int m = 0; m < MT; ++m)
                if (m == 0 || m < mc) {
                    tot[r][m] += warp_sum(part[r][m]);
                    part[r][m] = 0.0f;
                }
    }
}

// Per-lane weight pointers of one warp's rows, positioned at a step and advanced by fetch:
// in the dynamic loop a step then costs its loads and one pointer increment per row.
template <int R>
struct WPtr {
    const float* w[R];
};

template <int R, bool FULL>
__device__ __forceinline__ WStep<R> fetch(WPtr<R>& ptr, int k, int ke, int lane) {
    WStep<R> st;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
        const bool ok = FULL || k + lane + 32 * u < ke;
#pragma unroll
        for (int r = 0; r < R; ++r) st.w[r][u] = ok ? __ldg(ptr.w[r] + 32 * u) : 0.0f;
    }
#pragma unroll
    for (int r = 0; r < R; ++r) ptr.w[r] += mm_warp_step();
    return st;
}

// Split-K: the last block of row block rb to finish adds the super-chunks in ascending order.
template <int ROWS>
__device__ void split_reduce(const MmParams& p, int rb) {
    const int N = p.N;
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&p.counters[rb], 1u) == static_cast<unsigned>(p.splits - 1);
    __syncthreads();
    if (!last) return;  // uniform: `last` is shared
    __threadfence();
    const int nb = rb * KD_MM_WARPS * ROWS, rows = min(KD_MM_WARPS * ROWS, N - nb);
    for (int i = threadIdx.x; i < p.M * rows; i += KD_MM_THREADS) {
        const int m = i / rows, n = nb + i % rows;
        float v = 0.0f;
        for (int s = 0; s < p.splits; ++s) v += __ldcg(p.ws + (static_cast<long>(s) * p.M + m) * N + n);
        if (p.bias) v += p.bias[n];
        p.y[m * p.ldy + n] = v;
    }
    if (threadIdx.x == 0) p.counters[rb] = 0;
}

template <int MT, int R, bool GLU>
__global__ void __launch_bounds__(KD_MM_THREADS, 2) mm_kernel(MmParams p) {
    extern __shared__ float4 smem4[];
    float* xs = reinterpret_cast<float*>(smem4);   // [MT][kch] staged activations
    // Row totals of every row block this block owns (written and read by lane 0 of the warp
    // only): registers go to the loads in flight. R * MT <= 32.
    __shared__ float total[KD_MM_MAX_RB][KD_MM_WARPS][32];
    constexpr int WS = mm_warp_step();
    constexpr int ROWS = GLU ? R / 2 : R;  // output rows per warp
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int K = p.K, N = p.N;
    // Dynamic mode's units of ROWS rows, and a warp's first one (its place in the wave).
    const int n_units = (N + ROWS - 1) / ROWS, unit0 = blockIdx.x * KD_MM_WARPS + warp;
    // The lane's pointers for the rows n0 .. n0 + ROWS of weights a (and b) at input kb.
    const auto unit_ptrs = [&](const MmWeights& a, const MmWeights& b, int n0, int kb) {
        WPtr<R> ptr;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const long n = min(n0 + (GLU ? r % ROWS : r), N - 1);  // clamped rows are never stored
            const MmWeights& w = (GLU && r >= ROWS) ? b : a;
            ptr.w[r] = w.w + n * K + kb + lane;
        }
        return ptr;
    };
    // Dynamic mode's first weight step (issue 21, fifth pass): requested before the activations
    // are staged, so the two load latencies overlap, and in plain mode with constant weights
    // (p.weights_early) even before chain_acquire, while the kernel before this one drains.
    // fetch<R, false> gives the same values as the FULL variant of the loop below.
    const bool early = p.weights_early && !p.slot_expert && p.splits == 1 && K <= p.kch && p.M <= MT;
    WPtr<R> ptr0{};
    WStep<R> first{};
    if (early && unit0 < n_units) {
        ptr0 = unit_ptrs(p.a, p.b, unit0 * ROWS, 0);
        first = fetch<R, false>(ptr0, 0, K, lane);
    }
    chain_acquire();
    chain_release();

    MmWeights wa = p.a, wb = p.b;
    int m_begin = 0, m_count = p.M;
    if (p.slot_expert) {
        const int slot = blockIdx.y;
        if (slot >= *p.n_active) return;
        const long e = p.slot_expert[slot];
        m_begin = p.slot_start[slot];
        m_count = p.slot_start[slot + 1] - m_begin;
        wa.w += e * p.w_estride;
        if (GLU) wb.w += e * p.w_estride;
    }
    int kb = 0, ke = K;
    if (p.splits > 1) {
        kb = blockIdx.y * KD_MM_SCHUNK;
        ke = min(K, kb + KD_MM_SCHUNK);
    }
    // This block owns row blocks blockIdx.x + i * gridDim.x, i < n_my (<= KD_MM_MAX_RB). For each
    // token pass and each staged chunk of K, it streams the weights of all of them: activations
    // are staged once per chunk, whatever the number of row blocks.
    const int n_rb = (N + KD_MM_WARPS * ROWS - 1) / (KD_MM_WARPS * ROWS);
    const int n_my = blockIdx.x < n_rb ? (n_rb - 1 - blockIdx.x) / gridDim.x + 1 : 0;
    const auto first_row = [&](int i) { return ((blockIdx.x + i * gridDim.x) * KD_MM_WARPS + warp) * ROWS; };
    // The weights of warp step k of the warp's rows n0 .. n0 + ROWS.
    const auto load = [&](int n0, int k) {
        WStep<R> st;
        if (n0 < N) {
            const float* wrow[R];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int n = min(n0 + (GLU ? r % ROWS : r), N - 1);  // clamped rows are never stored
                const MmWeights& w = (GLU && r >= ROWS) ? wb : wa;
                wrow[r] = w.w + static_cast<long>(n) * K;
            }
            load_step<R>(st, wrow, k, ke, lane);
        }
        return st;
    };

    // Stages activation rows mc0 .. mc0 + mc, inputs kc .. kc_end, into shared memory. The rows
    // are one flat range, and a thread issues a batch of its loads before their stores, so the
    // rows' load latencies overlap (row by row, a small matmul's time grew by about a load
    // latency per row: Nsight Compute, tiny bundles, README "A DDTree round in one unit").
    const auto stage = [&](int kc, int kc_end, int mc0, int mc) {
        constexpr int kBatch = 4;
        const int len = kc_end - kc, total = mc * len;
        for (int base = threadIdx.x; base < total; base += kBatch * KD_MM_THREADS) {
            float v[kBatch];
#pragma unroll
            for (int u = 0; u < kBatch; ++u) {
                const int i = base + u * KD_MM_THREADS, m = i / len;
                if (i < total) {
                    const long prow = m_begin + mc0 + m;
                    v[u] = p.x[(p.row_in ? p.row_in[prow] : prow) * p.ldx + kc + (i - m * len)];
                }
            }
#pragma unroll
            for (int u = 0; u < kBatch; ++u) {
                const int i = base + u * KD_MM_THREADS, m = i / len;
                if (i < total) xs[m * p.kch + (i - m * len)] = v[u];
            }
        }
    };

    if (p.splits == 1 && ke - kb <= p.kch && m_count <= MT) {
        // Dynamic mode: all of K and all rows fit one staged chunk. Stage it once; then each
        // warp takes units of ROWS rows from a counter until none are left, so every warp
        // streams weights until the very end (no block-level imbalance).
        if (!early && unit0 < n_units) {
            ptr0 = unit_ptrs(wa, wb, unit0 * ROWS, kb);
            first = fetch<R, false>(ptr0, kb, ke, lane);
        }
        __shared__ long y_row[MT];  // output row offsets, read once rather than per unit
        if (threadIdx.x < m_count) {
            const long prow = m_begin + threadIdx.x;
            y_row[threadIdx.x] = (p.row_out ? p.row_out[prow] : prow) * p.ldy;
        }
        stage(kb, ke, 0, m_count);
        __syncthreads();
        unsigned* ctr = p.sched + 2 * (p.slot_expert ? blockIdx.y : 0);
        // A warp's first unit is its place in the wave; then it asks the counter (which counts
        // from there) when it starts a unit, and reads the answer at the unit's last step.
        // Short units: the next one is a wave further (round-robin).
        const int wave_units = gridDim.x * KD_MM_WARPS;
        const int n_steps = (ke - kb + WS - 1) / WS;
        const bool dealt = n_steps <= 2;
        const auto ask = [&](int unit) {
            return dealt ? unit + wave_units : lane == 0 ? static_cast<int>(atomicAdd(ctr, 1u)) + wave_units : 0;
        };
        const auto answer = [&](int ticket) { return dealt ? ticket : __shfl_sync(0xffffffffu, ticket, 0); };
        // FULL: every step lies wholly inside K, so no lane needs a bounds check.
        const auto run = [&](auto full) {
            constexpr bool FULL = decltype(full)::value;
            int unit = unit0;
            WPtr<R> ptr = ptr0;
            WStep<R> cur = first;
            WStep<R> other;
            while (unit < n_units) {
                const int ticket = ask(unit), n0 = unit * ROWS;
                int next = 0;
                float part[R][MT], tot[R][MT];
#pragma unroll
                for (int r = 0; r < R; ++r)
#pragma unroll
                    for (int m = 0; m < MT; ++m) part[r][m] = tot[r][m] = 0.0f;
                // Two steps per iteration with two register buffers (no copies): while one step
                // computes, the next one (in this unit or the next) is loading.
                // After the last step of the last unit the warp re-reads its unit's first step
                // (a wasted load, never used), so that every fetch is unconditional.
                const auto next_ptrs = [&]() {
                    next = answer(ticket);
                    return unit_ptrs(wa, wb, (next < n_units ? next : unit) * ROWS, kb);
                };
                for (int st = 0; st < n_steps; st += 2) {
                    const int k = kb + st * WS;
                    const bool last_a = st + 1 >= n_steps;
                    if (last_a) ptr = next_ptrs();
                    other = fetch<R, FULL>(ptr, last_a ? kb : k + WS, ke, lane);
                    mm_step_reduce<MT, R, FULL>(part, tot, cur, xs, p.kch, k, kb, ke, m_count, lane);
                    if (last_a) {  // odd step count: the next unit starts in `other`
                        cur = other;
                        break;
                    }
                    const bool last_b = st + 2 >= n_steps;
                    if (last_b) ptr = next_ptrs();
                    cur = fetch<R, FULL>(ptr, last_b ? kb : k + 2 * WS, ke, lane);
                    mm_step_reduce<MT, R, FULL>(part, tot, other, xs, p.kch, k + WS, kb, ke, m_count, lane);
                }
                if (lane == 0) {
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) {
                        const int n = n0 + r;
#pragma unroll
                        for (int m = 0; m < MT; ++m) {
                            if (m >= m_count || n >= N) continue;
                            float v = GLU ? silu_mul_f(tot[r][m], tot[r + ROWS][m]) : tot[r][m];
                            if (p.bias) v += p.bias[n];
                            p.y[y_row[m] + n] = v;
                        }
                    }
                }
                unit = next;
            }
        };
        if ((ke - kb) % WS == 0) run(std::true_type{});
        else run(std::false_type{});
        sched_block_done(ctr);
        return;
    }

    // Static mode: this block owns row blocks blockIdx.x + i * gridDim.x (see above). The
    // weights of one warp step are loaded one step ahead of their use (the step sequence runs
    // over token passes, chunks, row blocks, then K), so a warp always has loads in flight.
    WStep<R> cur{};
    if (n_my > 0) cur = load(first_row(0), kb);
    for (int mc0 = 0; mc0 < m_count; mc0 += MT) {
        const int mc = min(MT, m_count - mc0);
        if (lane == 0)
            for (int i = 0; i < n_my; ++i)
                for (int j = 0; j < R * MT; ++j) total[i][warp][j] = 0.0f;
        for (int kc = kb; kc < ke; kc += p.kch) {
            const int kc_end = min(ke, kc + p.kch);
            __syncthreads();  // the previous chunk is no longer read
            stage(kc, kc_end, mc0, mc);
            __syncthreads();
            for (int i = 0; i < n_my; ++i) {
                const int n0 = first_row(i);
                float part[R][MT];
#pragma unroll
                for (int r = 0; r < R; ++r)
#pragma unroll
                    for (int m = 0; m < MT; ++m) part[r][m] = 0.0f;
                for (int k = kc; k < kc_end; k += WS) {
                    // The next step: next k, next row block, next chunk, next token pass.
                    int ni = i, nk = k + WS;
                    if (nk >= kc_end) {
                        ni = i + 1 < n_my ? i + 1 : 0;
                        nk = i + 1 < n_my ? kc : kc_end < ke ? kc_end : mc0 + MT < m_count ? kb : -1;
                    }
                    const WStep<R> nxt = nk >= 0 ? load(first_row(ni), nk) : cur;
                    if (n0 < N) {
                        mm_step<MT, R>(part, cur, xs, p.kch, k, kc, ke, mc, lane);
                        if ((k + WS) % KD_MM_SCHUNK == 0 || k + WS >= ke) {  // end of a super-chunk
#pragma unroll
                            for (int r = 0; r < R; ++r)
#pragma unroll
                                for (int m = 0; m < MT; ++m)
                                    if (m == 0 || m < mc) {
                                        const float v = warp_sum(part[r][m]);
                                        if (lane == 0) total[i][warp][r * MT + m] += v;
                                        part[r][m] = 0.0f;
                                    }
                        }
                    }
                    cur = nxt;
                }
            }
        }
        if (lane == 0) {
            for (int i = 0; i < n_my; ++i) {
                const int n0 = first_row(i);
                const float* t = total[i][warp];
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    const int n = n0 + r;
                    if (n >= N) continue;
#pragma unroll
                    for (int m = 0; m < MT; ++m) {
                        if (m >= mc) continue;
                        const long prow = m_begin + mc0 + m;
                        if (p.splits > 1) {
                            p.ws[(static_cast<long>(blockIdx.y) * p.M + prow) * N + n] = t[r * MT + m];
                        } else {
                            float v = GLU ? silu_mul_f(t[r * MT + m], t[(r + ROWS) * MT + m]) : t[r * MT + m];
                            if (p.bias) v += p.bias[n];
                            p.y[(p.row_out ? p.row_out[prow] : prow) * p.ldy + n] = v;
                        }
                    }
                }
            }
        }
    }
    if (p.splits > 1)
        for (int i = 0; i < n_my; ++i) split_reduce<ROWS>(p, blockIdx.x + i * gridDim.x);
}

// One activation row, narrow outputs (mm_run_plain where split-K would be chosen: row blocks
// alone would leave SMs idle; the MoE router, 384 x 7168): a warp per (output, super-chunk)
// loads all its weights of the super-chunk at once (16 steps x 4 words a lane: one load latency
// where mm_kernel's warps wait for 16 steps in turn), the block's warps take rpb outputs x n_sc
// super-chunks, and the block adds the super-chunk values itself (no workspace, no count, no
// second launch). The arithmetic is mm_kernel's: a lane's inputs k + lane + 32u (steps of 128,
// u = 0..3) in ascending order from 0, the xor butterfly, then 0 + value_0 + value_1 + ...
// (+ bias): the same bits as every other path.
constexpr int KD_MM_NARROW_STEPS = KD_MM_SCHUNK / 128;

// Outputs per block of mm_narrow_kernel for n_sc super-chunks: a warp per (output, super-chunk),
// at most KD_MM_WARPS warps (more super-chunks: a warp takes several in turn).
inline int mm_narrow_rows(int n_sc) { return std::max(1, KD_MM_WARPS / n_sc); }

template <int STEPS>
__global__ void __launch_bounds__(KD_MM_THREADS, 2) mm_narrow_kernel(MmParams p, int rpb) {
    extern __shared__ float4 smem4[];
    float* xs = reinterpret_cast<float*>(smem4);  // [K] the row's activations, then [units] values
    const int K = p.K, N = p.N, n_sc = (K + KD_MM_SCHUNK - 1) / KD_MM_SCHUNK, units = rpb * n_sc;
    float* val = xs + K;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n_warps = blockDim.x >> 5;
    const int r0 = blockIdx.x * rpb;
    chain_acquire();
    chain_release();
    float w[STEPS][4];
    // Weights of unit u (output r0 + u / n_sc, super-chunk u % n_sc), all issued before any use.
    const auto load = [&](int u) {
        const int n = r0 + u / n_sc, kb = (u % n_sc) * KD_MM_SCHUNK, ke = min(K, kb + KD_MM_SCHUNK);
        const float* wr = p.a.w + static_cast<long>(min(n, N - 1)) * K;  // a clamped row is never stored
#pragma unroll
        for (int st = 0; st < STEPS; ++st)
#pragma unroll
            for (int u4 = 0; u4 < 4; ++u4) {
                const int kk = kb + st * 128 + lane + 32 * u4;
                w[st][u4] = kk < ke ? __ldg(wr + kk) : 0.0f;
            }
    };
    int u = warp;
    if (u < units) load(u);
    // The activations, while the weights are on their way.
    if (K % 4 == 0 && reinterpret_cast<uintptr_t>(p.x) % 16 == 0) {
        const float4* x4 = reinterpret_cast<const float4*>(p.x);
        float4* xs4 = reinterpret_cast<float4*>(xs);
        for (int i = threadIdx.x; i < K / 4; i += 8 * blockDim.x) {
            float4 v[8];
#pragma unroll
            for (int j = 0; j < 8; ++j)
                if (i + j * blockDim.x < K / 4) v[j] = __ldg(x4 + i + j * blockDim.x);
#pragma unroll
            for (int j = 0; j < 8; ++j)
                if (i + j * blockDim.x < K / 4) xs4[i + j * blockDim.x] = v[j];
        }
    } else {
        for (int i = threadIdx.x; i < K; i += blockDim.x) xs[i] = __ldg(p.x + i);
    }
    __syncthreads();
    for (; u < units; u += n_warps) {
        if (u != warp) load(u);
        const int kb = (u % n_sc) * KD_MM_SCHUNK, ke = min(K, kb + KD_MM_SCHUNK);
        float part = 0.0f;
#pragma unroll
        for (int st = 0; st < STEPS; ++st)
#pragma unroll
            for (int u4 = 0; u4 < 4; ++u4) {
                const int kk = kb + st * 128 + lane + 32 * u4;
                if (kk < ke) part = fmaf(w[st][u4], xs[kk], part);
            }
        part = warp_sum(part);
        if (lane == 0) val[u] = part;
    }
    __syncthreads();
    for (int r = threadIdx.x; r < rpb; r += blockDim.x) {
        const int n = r0 + r;
        if (n >= N) continue;
        float v = 0.0f;
        for (int c = 0; c < n_sc; ++c) v += val[r * n_sc + c];
        if (p.bias) v += p.bias[n];
        p.y[n] = v;
    }
}

// Whether mm_run_plain takes mm_narrow_kernel: one row, split-K would be chosen, and the row and
// the values fit the kernel's shared memory.
inline bool mm_narrow_fits(int M, int splits, int K) {
    const int n_sc = ceil_div(K, KD_MM_SCHUNK);
    return M == 1 && splits > 1 && K + mm_narrow_rows(n_sc) * n_sc <= KD_MM_SMEM_FLOATS;
}

inline void mm_narrow_launch(const MmParams& p, cudaStream_t stream) {
    const auto kernel = mm_narrow_kernel<KD_MM_NARROW_STEPS>;
    static bool configured = false;
    if (!configured) {
        KD_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(sizeof(float)) * KD_MM_SMEM_FLOATS));
        configured = true;
    }
    const int n_sc = ceil_div(p.K, KD_MM_SCHUNK), rpb = mm_narrow_rows(n_sc);
    const int warps = std::min(KD_MM_WARPS, rpb * n_sc);
    const int smem = static_cast<int>(sizeof(float)) * (p.K + rpb * n_sc);
    launch_chained("mm_narrow_kernel launch", kernel, dim3(ceil_div(p.N, rpb)), dim3(32 * warps), smem, stream,
                   p, rpb);
}

// Rows per pass for a call whose largest row count is max_rows.
inline int mm_pass_rows(int max_rows) {
    return max_rows <= 1 ? 1 : max_rows <= 2 ? 2 : max_rows <= 4 ? 4 : KD_MM_MAX_PASS;
}

// Split-K when the row blocks alone would leave SMs idle; every super-chunk then gets a block.
// Free to depend on anything: the result is bit-identical either way.
inline int mm_split_count(int num_sms, int N, int K, int max_rows) {
    const int rows_per_block = KD_MM_WARPS * mm_rows_per_warp(mm_pass_rows(max_rows));
    const int super_chunks = ceil_div(K, KD_MM_SCHUNK);
    return ceil_div(N, rows_per_block) < num_sms && super_chunks > 1 ? super_chunks : 1;
}

// Launches mm_kernel for MT activation rows per pass (1, 2, 4 or 8; more rows take more passes).
// grid.y: slots (grouped) or splits (split-K), else 1.
template <int MT, bool GLU>
void mm_launch_mt(const MmParams& p, int grid_y, int num_sms, cudaStream_t stream) {
    constexpr int R = mm_rows_per_warp(MT);
    constexpr int ROWS = GLU ? R / 2 : R;
    const auto kernel = mm_kernel<MT, R, GLU>;
    const int smem = static_cast<int>(sizeof(float)) * MT * p.kch;
    static bool configured = false;  // one attribute call per instantiation
    if (!configured) {
        KD_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(sizeof(float)) * KD_MM_SMEM_FLOATS));
        configured = true;
    }
    // Static mode: at most one resident wave of blocks, each owning the same number of row
    // blocks (at most KD_MM_MAX_RB). Dynamic mode: one full wave; warps share the work.
    int per_sm = 0;
    // The occupancy depends on smem alone here (the same kernel, block and device): a query per
    // size, not per launch (a host call on the path of every small matmul of a decode step).
    static std::pair<int, int> known[8];  // (smem + 1, blocks per SM); 0: empty
    for (const auto& k : known)
        if (k.first == smem + 1) per_sm = k.second;
    if (per_sm == 0) {
        KD_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, KD_MM_THREADS, smem));
        static int next = 0;
        known[next] = {smem + 1, per_sm};
        next = (next + 1) % 8;
    }
    const int n_rb = ceil_div(p.N, KD_MM_WARPS * ROWS);
    const int wave = std::max(1, std::max(1, per_sm) * num_sms / grid_y);
    const int rounds = std::min(KD_MM_MAX_RB, ceil_div(n_rb, wave));
    int grid_x = ceil_div(n_rb, rounds);
    if (p.splits == 1 && p.kch >= p.K && (p.slot_expert || p.M <= MT))  // dynamic mode: a full wave
        grid_x = std::max(std::min(wave, ceil_div(ceil_div(p.N, ROWS), KD_MM_WARPS)), ceil_div(n_rb, KD_MM_MAX_RB));
    launch_chained("mm_kernel launch", kernel, dim3(grid_x, grid_y), dim3(KD_MM_THREADS), smem, stream, p);
}

template <bool GLU>
void mm_launch(MmParams p, int max_rows, int grid_y, int num_sms, cudaStream_t stream) {
    const int mt = mm_pass_rows(max_rows);
    p.kch = mm_stage_chunk(mt, p.splits > 1 ? KD_MM_SCHUNK : p.K);
    switch (mt) {
        case 1: mm_launch_mt<1, GLU>(p, grid_y, num_sms, stream); break;
        case 2: mm_launch_mt<2, GLU>(p, grid_y, num_sms, stream); break;
        case 4: mm_launch_mt<4, GLU>(p, grid_y, num_sms, stream); break;
        default: mm_launch_mt<KD_MM_MAX_PASS, GLU>(p, grid_y, num_sms, stream); break;
    }
}

// Instantiated once, in matmul_f32.cu: moe_ffn.cu uses both without compiling the kernels again.
extern template void mm_launch<false>(MmParams, int, int, int, cudaStream_t);
extern template void mm_launch<true>(MmParams, int, int, int, cudaStream_t);

// Sets the input rows (x, ldx floats apart), the output rows (y, ldy apart) and the N x K shape.
inline void mm_set_rows(MmParams& p, const float* x, long ldx, float* y, long ldy, int N, int K) {
    p.x = x;
    p.ldx = ldx;
    p.y = y;
    p.ldy = ldy;
    p.N = N;
    p.K = K;
}

// A plain (not grouped) matmul y[M][N] = x[M][K] W^T: the row and shape fields, split-K with its
// workspace when the grid would leave SMs idle, the scheduling counters, and the launch. The
// caller has set the weights (p.a) and the bias, if any.
inline void mm_run_plain(Context& ctx, MmParams& p, float* y, const float* x, int M, int N, int K) {
    mm_set_rows(p, x, K, y, N, N, K);
    p.M = M;
    p.splits = mm_split_count(ctx.num_sms, N, K, M);
    if (mm_narrow_fits(M, p.splits, K)) {
        mm_narrow_launch(p, ctx.stream);
        return;
    }
    if (p.splits > 1) {
        p.ws = ctx.split_ws.get<float>(static_cast<size_t>(p.splits) * M * N);
        p.counters = ctx.split_counters.get<unsigned>(static_cast<size_t>(ceil_div(N, KD_MM_WARPS)));
    }
    p.sched = ctx.sched.get<unsigned>(2);
    mm_launch<false>(p, M, p.splits, ctx.num_sms, ctx.stream);
}

}  // namespace kd::cuda
