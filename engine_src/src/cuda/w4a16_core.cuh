// w4a16_core.cuh: the INT4 matmul kernel behind matmul_w4a16 and the INT4 expert FFN of
// moe_ffn: y[m][n] = sum_k x[m][k] W[n][k], W in the W4A16 layout of backend.h, x and y fp32,
// the products on tensor cores (mma.sync m16n8k16, fp16 operands, fp32 accumulation).
//
// Why tensor cores: at one token row, dequantising a nibble and multiplying it on the FMA pipes
// costs ~3 instructions a weight, and the instruction issue, not DRAM, bounded the old kernel
// (a pure dequant+FMA stream topped out at ~2.5 TB/s on the H200). Here a nibble costs one
// instruction (a shift and a LOP3 make two fp16 weights) and the multiply-adds go to the mma.
//
// The exact operands
//   * Weights: a LOP3 turns two nibbles n into the fp16 values 16 + n (exact); the offset is
//     removed per group with the group's activation sum X: sum (n - 8) x = sum (16 + n) x - 24 X.
//   * Activations: per token and super-chunk (KD_W4_SCHUNK inputs), x is scaled by the power of
//     two that puts its largest |x| in [2^13, 2^14) and split into fp16 hi + lo halves (~22
//     significant bits, no fp16 overflow whatever the range of x); the mma's 8 columns are 4
//     tokens x (hi, lo), so one mma serves both halves of 4 tokens.
//
// Shape of the work
//   * A block is 8 warps and stages one super-chunk of the activations of up to 32 token rows
//     (16 of its slot's rows when grouped) in shared memory in the mma's B-fragment order.
//   * Weights in the tiled layout (upload_w4a16 writes it; see w4a16_tile_kernel): per 8 rows and
//     step of 8 groups, 1 KB of words in the order the lanes read them (each word's nibbles in
//     w4_word_order's places), so each 16-byte load of a warp reads 512 contiguous bytes, and
//     256 bytes of scales. N is padded to 8 rows, K to 256 inputs, with zeros.
//   * A warp's tile is 16 weight rows (the mma's rows; with the fused SwiGLU epilogue 8 w1 rows
//     and their 8 w3 rows) over the block's super-chunk; lane (g, t) = (lane / 4, lane % 4) gets
//     word t of each group of rows g and g + 8 and the scales of groups 2t, 2t + 1, 8 groups a
//     step, the next step loading while one computes. Warps take tiles from a counter per (slot,
//     super-chunk) until none are left.
//   * Grid: blockIdx.y = super-chunk, blockIdx.z = slot; blockIdx.x shares that pair's tiles.
//
// The arithmetic of one output (the DDTree == AR invariant of backend.h)
//   For token m, weight row n, super-chunk c, group G (ascending): v = ((d_hi + e_hi) + (d_lo +
//   e_lo)) + (-24 X) with d, e the mma sums of the group's two k-steps, part = fma(scale, v, part) from part = 0; the super-chunk's
//   value is part * 2^-e (its activation scale); the output is 0 + value_0 + value_1 + ... in
//   ascending super-chunk order (one super-chunk: written directly; more: through a workspace,
//   summed by w4_sum_kernel, the launch after, or in the same launch by the tile's last warp,
//   w4_tail_plain, in the same order). Nothing depends on M, on the token's place among the
//   rows, on the row's place in the tile, on the schedule or on grouping, so matmul_w4a16 and
//   moe_ffn give bit-identical rows at every M.
#pragma once

#include "common.cuh"
#include "context.cuh"

#include <cuda_fp16.h>

#include <algorithm>
#include <cstdlib>
#include <type_traits>

namespace kd::cuda {

constexpr int KD_W4_WARPS = 8;
// Outputs of one warp tile: 16 weight rows, or with the SwiGLU epilogue 8 of w1 and their 8 of w3.
__host__ __device__ constexpr int w4_tile_outputs(bool glu) { return glu ? 8 : 16; }
constexpr int KD_W4_THREADS = 32 * KD_W4_WARPS;
// Inputs per super-chunk. A warp's unit of work is a tile over a super-chunk: 1024 inputs make it
// 4 steps, so the units even out over the grid's warps (2048, 8 steps: 28672 x 8192 at one
// token gave 3.4 units a warp, a last round beside idle warps, 70 % of the read ceiling against
// 75 %; 512 pays the staging and the split-K sum twice as often: issue 21, eighth pass).
constexpr int KD_W4_SCHUNK = 1024;
constexpr int KD_W4_GROUPS = KD_W4_SCHUNK / 32;          // quantisation groups per super-chunk
constexpr int KD_W4_STEP = 8;                            // groups per warp step
constexpr int KD_W4_MAX_ROWS = 32;                       // token rows per plain launch (one pass of 8 quads)
constexpr int KD_W4_GROUPED_ROWS = 16;                   // token rows per grouped launch's slot (moe_ffn's passes)
constexpr int KD_W4_ROW_BYTES = KD_W4_GROUPS * 64 + 64;  // one staged B row; the pad keeps LDS.128 conflict-free

struct W4Params {
    const uint32_t* q = nullptr;   // tiled words (w1 with the SwiGLU epilogue), see w4a16_tile_kernel
    const float* s = nullptr;      // tiled scales
    const uint32_t* q3 = nullptr;  // SwiGLU: w3
    const float* s3 = nullptr;
    long q_estride = 0, s_estride = 0;  // grouped: words / scales between experts (w4a16_tiled_*)
    const float* x = nullptr;
    long ldx = 0;
    float* y = nullptr;
    long ldy = 0;
    int M = 0, N = 0, K = 0;  // M: token rows (plain) or pairs (grouped)
    int sc_len = KD_W4_SCHUNK;  // inputs per super-chunk: a multiple of 256, at most KD_W4_SCHUNK (w4_schunk())
    int n_sc = 1;             // super-chunks of K
    int max_passes = 1;       // passes of 4Q token rows a slot may take (counters are per pass)
    // Grouped mode (slot_expert != null): slot s has the rows [slot_start[s], slot_start[s + 1])
    // of a sorted (expert, token) pair list; x row row_in[p], y row row_out[p] (null: p).
    const int* slot_expert = nullptr;
    const int* slot_start = nullptr;
    const int* n_active = nullptr;
    const int* row_in = nullptr;
    const int* row_out = nullptr;
    float* ws = nullptr;            // n_sc > 1: [n_sc][M][N (2N with SwiGLU)] super-chunk values
    unsigned* sched = nullptr;      // [slots * n_sc][max_passes][2]: next tile, blocks done; zero between launches
    // Plain, n_sc > 1, one pass of at most 4 rows, every warp one tile (w4_run and w4_launch_q
    // decide): the super-chunk values are summed in this launch by the last warp to finish a tile
    // (w4_tail_plain), not by w4_sum_kernel. [tiles] arrival counts, zero between launches (the
    // last warp resets its tile's).
    unsigned* tail_ctr = nullptr;
    // The weights and (grouped) the slot lists were written two launches back or more (moe_ffn's
    // w2: model weights, lists from the gate or moe_lists_kernel before w1/w3's launch): each
    // warp's first two steps are fetched before griddepcontrol.wait, which then comes before the
    // staging (the input rows) and every write, so those loads overlap the launch before's tail.
    bool early = false;
    // w4_sum_kernel issues a thread's loads together (KD_W4_SUM_BATCH values, the slot count and
    // the output row beside them) instead of one value after the other: moe_ffn at one row.
    bool sum_together = false;
    // Grouped, one row (moe_ffn's w1/w3 launch with the shared expert as its last slot): the blocks
    // of slot prefetch_slot, whose expert prefetch_expert is known before the gate has run, ask L2
    // for that expert's words and scales (q, q3, s, s3; their share of them) before
    // griddepcontrol.wait, so those bytes are read while the router and the gate run. A hint
    // only: nothing is read into registers and no result depends on it. -1: none.
    int prefetch_slot = -1;
    long prefetch_expert = 0;
};

// Two nibbles of `shifted` (bits 6..9 and 22..25) as the fp16 pair (16 + n_lo, 16 + n_hi).
__device__ __forceinline__ uint32_t nibble_pair(uint32_t shifted) {
    uint32_t h;
    asm("lop3.b32 %0, %1, 0x03C003C0, 0x4C004C00, 0xea;" : "=r"(h) : "r"(shifted));
    return h;
}

// A word of the bundle's layout (nibble i, bits 4i .. 4i + 3, is input i) in the tiled layout's
// order: nibbles 0 and 4 at bits 6..9 and 22..25 (nibble_pair takes them as they are), 1 and 5
// at 2..5 and 18..21 (after a left shift by 4), 2 and 6 at 10..13 and 26..29 (a right shift by
// 4), 3 and 7 at bits 30, 31, 0, 1 and 14..17 (a left rotation by 8): three shifts for four
// pairs instead of four.
__host__ __device__ __forceinline__ uint32_t w4_word_order(uint32_t o) {
    const auto nib = [&](int i) { return (o >> (4 * i)) & 15u; };
    const uint32_t n3 = nib(3) << 6;
    return nib(0) << 6 | nib(4) << 22 | nib(1) << 2 | nib(5) << 18 | nib(2) << 10 | nib(6) << 26 |
           (n3 >> 8 | n3 << 24) | nib(7) << 14;
}

// d += A B for one m16n8k16 tile (fp16 operands, fp32 accumulators).
__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                          uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One warp step of a lane: word t of 8 groups of its two rows, and the scales of groups 2t and
// 2t + 1 of each (the four lanes of a row share their scales by shuffles: fewer registers).
struct W4Step {
    uint4 wa[2], wb[2];
    float2 sa, sb;
};

// A lane's place in the tiled weights of its two half-tiles at the block's first step.
struct W4Rows {
    const uint4 *qa, *qb;
    const float2 *sa, *sb;
};

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// ld_stream that the compiler may not move or speculate: for a load behind a test of its
// address's validity (a plain asm without side effects may be hoisted above the test).
__device__ __forceinline__ uint4 ld_stream_guarded(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

template <bool GUARDED = false>
__device__ __forceinline__ W4Step w4_fetch(const W4Rows& r, int step) {
    W4Step st;
    const int b = step * 64;  // uint4s per step of a half-tile: 2 loads x 32 lanes
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        st.wa[j] = GUARDED ? ld_stream_guarded(r.qa + b + 32 * j) : ld_stream(r.qa + b + 32 * j);
        st.wb[j] = GUARDED ? ld_stream_guarded(r.qb + b + 32 * j) : ld_stream(r.qb + b + 32 * j);
    }
    st.sa = __ldg(r.sa + step * 32);
    st.sb = __ldg(r.sb + step * 32);
    return st;
}

__device__ __forceinline__ uint32_t word_of(const uint4 (&w)[2], int i) {
    const uint4& v = w[i / 4];
    return i % 4 == 0 ? v.x : i % 4 == 1 ? v.y : i % 4 == 2 ? v.z : v.w;
}

// Whether w4_kernel<Q> runs full steps without per-group tests (see w4_step) where K allows:
// one token quad, and 8 (one block per SM, up to 255 registers: 32-row passes 10 % faster than
// with the tested steps, issue 38's tenth pass). Not 2: the interleaved groups need more
// registers than two blocks per SM leave, and spill. Not 4: with one block per SM (166 -> 176
// registers) its 16-row passes took 7 % longer (15 % fewer instructions, issued more slowly).
// This decides the staged layout (w4_xstride, the zero rows of missing tokens) on host and
// device alike; w4_full_steps_here whether the kernel of this arch takes them.
__host__ __device__ constexpr bool w4_full_steps(int Q) { return Q == 1 || Q == 8; }

__device__ constexpr bool w4_full_steps_here(int Q) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
    return Q == 1;  // sm_120: 4 and 8 quads spilled at 255 registers (nvcc 13.0)
#else
    return w4_full_steps(Q);
#endif
}

// -24 X floats per staged row: pads that spread the 4 rows' banks, 16-byte rows for the full
// steps' vector loads (the other passes keep the tighter rows: fewer registers at Q = 2).
__host__ __device__ constexpr int w4_xstride(int Q) { return KD_W4_GROUPS + (w4_full_steps(Q) ? 4 : 1); }

// Adds one step's groups into part[q][0 | 1] (rows g | g + 8, token 4q + t).
// bsm: the staged B rows; xneg: -24 X per (token, group); m_count: staged tokens.
// FULL: the step has all its groups (K a multiple of 256 in this super-chunk): no test per
// group, so the groups' independent chains interleave, and the staged rows past m_count are
// zeros (w4_stage), so every B load is unconditional. The arithmetic is the same either way.
template <int Q, bool FULL>
__device__ __forceinline__ void w4_step(float (&part)[Q][2], const W4Step& st, int step, int n_groups,
                                        const unsigned char* bsm, const float* xneg, int m_count, int lane) {
    const int g = lane >> 2, t = lane & 3;
    float4 xn4[Q];  // FULL: -24 X of 4 groups at a time, one 16-byte load
#pragma unroll
    for (int i = 0; i < KD_W4_STEP; ++i) {
        const int G = step * KD_W4_STEP + i;
        if (!FULL && G >= n_groups) break;  // past K (uniform)
        // Word t holds inputs 8t .. 8t + 7 of the group in w4_word_order's places; the mma's
        // k = 2t, 2t + 1, 2t + 8, 2t + 9 of its two k-steps take inputs 8t + {0, 4, 1, 5} and
        // 8t + {2, 6, 3, 7}: nibble pairs (0, 4), (1, 5), (2, 6), (3, 7), one shift or rotation
        // each but the first.
        const uint32_t wa = word_of(st.wa, i), wb = word_of(st.wb, i);
        const uint32_t a04 = nibble_pair(wa), a15 = nibble_pair(wa << 4), a26 = nibble_pair(wa >> 4),
                       a37 = nibble_pair(__funnelshift_l(wa, wa, 8));
        const uint32_t b04 = nibble_pair(wb), b15 = nibble_pair(wb << 4), b26 = nibble_pair(wb >> 4),
                       b37 = nibble_pair(__funnelshift_l(wb, wb, 8));
        // Lane i / 2 of this row's 4 lanes loaded group i's scales: a shuffle of width 4 takes
        // the lane as an immediate (no register per source lane).
        const float scale_a = __shfl_sync(0xffffffffu, i & 1 ? st.sa.y : st.sa.x, i >> 1, 4);
        const float scale_b = __shfl_sync(0xffffffffu, i & 1 ? st.sb.y : st.sb.x, i >> 1, 4);
#pragma unroll
        for (int q = 0; q < Q; ++q) {
            // B column g = token 4q + g / 2, half g % 2; missing tokens read as zeros.
            const unsigned char* bp = bsm + (8 * q + g) * KD_W4_ROW_BYTES + G * 64 + t * 16;
            uint4 bx = make_uint4(0u, 0u, 0u, 0u);
            if (FULL || 4 * q + (g >> 1) < m_count) bx = *reinterpret_cast<const uint4*>(bp);
            // The group's two k-steps into separate accumulators (two independent mma).
            float d[4] = {0.0f, 0.0f, 0.0f, 0.0f}, e[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            mma_16816(d, a04, b04, a15, b15, bx.x, bx.y);
            mma_16816(e, a26, b26, a37, b37, bx.z, bx.w);
            const float* xr = xneg + (4 * q + t) * w4_xstride(Q);
            float xn;
            if (FULL) {
                if (i % 4 == 0) xn4[q] = *reinterpret_cast<const float4*>(xr + G);
                xn = i % 4 == 0 ? xn4[q].x : i % 4 == 1 ? xn4[q].y : i % 4 == 2 ? xn4[q].z : xn4[q].w;
            } else {
                xn = xr[G];
            }
            part[q][0] = fmaf(scale_a, ((d[0] + e[0]) + (d[1] + e[1])) + xn, part[q][0]);
            part[q][1] = fmaf(scale_b, ((d[2] + e[2]) + (d[3] + e[3])) + xn, part[q][1]);
        }
    }
}

// Whether w4_stage<Q> first copies every row's inputs into shared memory, all rows' copies in
// flight together, and reads them from there: passes of 16 rows and more (28672 x 8192 at 32 and
// 64 rows 1.055x on an H100; 2-8 rows, read twice from global memory one row after the other,
// were 0.96-1.00x with the copies: issue 38's eleventh pass). The same bits either way.
__host__ __device__ constexpr bool w4_stage_copies(int Q) { return Q >= 4; }

// BYTES (16: 4 inputs; 4: one) from global to shared memory without registers (cp.async,
// sm_80 and later; a load and a store before).
template <int BYTES>
__device__ __forceinline__ void w4_copy(void* dst, const float* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    if constexpr (BYTES == 16) asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
    else asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d), "l"(src) : "memory");
#else
    if constexpr (BYTES == 16) *reinterpret_cast<float4*>(dst) = *reinterpret_cast<const float4*>(src);
    else *reinterpret_cast<float*>(dst) = *src;
#endif
}

// Token row prow's inputs from kb on, in global memory (grouped: x row row_in[prow]).
__device__ __forceinline__ const float* w4_input_row(const W4Params& p, long prow, int kb) {
    return p.x + (p.row_in ? p.row_in[prow] : prow) * p.ldx + kb;
}

// Where w4_copy_rows puts token j's inputs: the first of its two staged rows.
__device__ __forceinline__ float* w4_copied_row(unsigned char* bsm, int j) {
    return reinterpret_cast<float*>(bsm + 2 * j * KD_W4_ROW_BYTES);
}

// w4_stage_copies: rows m_begin .. m_begin + m_count of x, inputs kb .. kb + klen, as they are,
// each into its token's two staged rows (klen floats, at most 4 KiB of the 2 ROW_BYTES), every
// copy in flight before the one wait. Ends with the block synchronised.
template <int Q>
__device__ __forceinline__ void w4_copy_rows(const W4Params& p, int m_begin, int m_count, int kb, int klen,
                                             unsigned char* bsm) {
    __shared__ const float* src[4 * Q];
    if (threadIdx.x < static_cast<unsigned>(m_count)) src[threadIdx.x] = w4_input_row(p, m_begin + threadIdx.x, kb);
    __syncthreads();
    if ((reinterpret_cast<uintptr_t>(p.x) | static_cast<uintptr_t>(p.ldx) * 4u | static_cast<uintptr_t>(kb) * 4u) % 16 == 0) {
        const int per_row = klen / 4;
        for (int i = threadIdx.x; i < m_count * per_row; i += KD_W4_THREADS)
            w4_copy<16>(w4_copied_row(bsm, i / per_row) + 4 * (i % per_row), src[i / per_row] + 4 * (i % per_row));
    } else {
        for (int i = threadIdx.x; i < m_count * klen; i += KD_W4_THREADS) w4_copy<4>(w4_copied_row(bsm, i / klen) + i % klen, src[i / klen] + i % klen);
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n\tcp.async.wait_group 0;" ::: "memory");
#endif
    __syncthreads();
}

// Stages rows m_begin .. m_begin + m_count of x, inputs kb .. kb + klen, as B fragments (see
// the file comment), with -24 X per group and each row's scale 2^-e in fac. Warp w takes groups
// w, w + 8, ... of every row (loads in flight together), from global memory or (w4_stage_copies)
// from the rows' copies, which the row's fragments then overwrite; pmax: [at least 4Q rows][warps]
// scratch. Ends with the block synchronised.
template <int Q>
__device__ __forceinline__ void w4_stage(const W4Params& p, int m_begin, int m_count, int kb, int klen,
                                         unsigned char* bsm, float* xneg, float* fac, float* pmax) {
    constexpr int PER_WARP = KD_W4_GROUPS / KD_W4_WARPS;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n_groups = klen / 32;
    // The rows of missing tokens (m_count .. 4Q) as zeros, for w4_step's unconditional loads.
    constexpr int ROW_VECS = KD_W4_ROW_BYTES / 16, xstride = w4_xstride(Q);
    uint4* zero_rows = reinterpret_cast<uint4*>(bsm + 2 * m_count * KD_W4_ROW_BYTES);
    if (w4_full_steps(Q)) {
        for (int i = threadIdx.x; i < (4 * Q - m_count) * 2 * ROW_VECS; i += KD_W4_THREADS) zero_rows[i] = make_uint4(0u, 0u, 0u, 0u);
        for (int i = threadIdx.x; i < (4 * Q - m_count) * xstride; i += KD_W4_THREADS) xneg[m_count * xstride + i] = 0.0f;
    }
    const auto row = [&](int j) -> const float* {
        if constexpr (w4_stage_copies(Q)) return w4_copied_row(bsm, j);
        return w4_input_row(p, m_begin + j, kb);
    };
    if constexpr (w4_stage_copies(Q)) w4_copy_rows<Q>(p, m_begin, m_count, kb, klen, bsm);
    for (int j = 0; j < m_count; ++j) {  // each warp's largest |x| of each row
        const float* xr = row(j);
        float v[PER_WARP];
#pragma unroll
        for (int i = 0; i < PER_WARP; ++i) {
            const int G = warp + KD_W4_WARPS * i;
            v[i] = G < n_groups ? fabsf(xr[32 * G + lane]) : 0.0f;
        }
        float mx = 0.0f;
#pragma unroll
        for (int i = 0; i < PER_WARP; ++i) mx = fmaxf(mx, v[i]);
        mx = warp_max(mx);
        if (lane == 0) pmax[j * KD_W4_WARPS + warp] = mx;
    }
    __syncthreads();
    // Lane l holds input l of a group: word l / 8, nibble e8 = l % 8, at half 2 (e8 % 4) + e8 / 4
    // of the lane-(l / 8) fragment.
    const int off = (lane >> 3) * 16 + 2 * (2 * (lane & 3) + ((lane >> 2) & 1));
    for (int j = 0; j < m_count; ++j) {
        float mx = 0.0f;
        for (int w = 0; w < KD_W4_WARPS; ++w) mx = fmaxf(mx, pmax[j * KD_W4_WARPS + w]);
        int ex = 0;
        frexpf(mx, &ex);  // mx = f 2^ex, f in [0.5, 1)
        const int e = max(-126, min(126, 14 - ex));
        const float up = ldexpf(1.0f, e);
        if (threadIdx.x == 0) fac[j] = ldexpf(1.0f, -e);
        unsigned char* hi = bsm + 2 * j * KD_W4_ROW_BYTES;
        unsigned char* lo = hi + KD_W4_ROW_BYTES;
        const float* xr = row(j);
        float v[PER_WARP];
#pragma unroll
        for (int i = 0; i < PER_WARP; ++i) {
            const int G = warp + KD_W4_WARPS * i;
            v[i] = G < n_groups ? xr[32 * G + lane] * up : 0.0f;
        }
        if constexpr (w4_stage_copies(Q)) __syncthreads();  // the row's copy all read before its fragments overwrite it
#pragma unroll
        for (int i = 0; i < PER_WARP; ++i) {
            const int G = warp + KD_W4_WARPS * i;
            if (G >= n_groups) break;
            const float X = warp_sum(v[i]);
            if (lane == 0) xneg[j * xstride + G] = -24.0f * X;
            const __half h = __float2half_rn(v[i]);
            *reinterpret_cast<__half*>(hi + G * 64 + off) = h;
            *reinterpret_cast<__half*>(lo + G * 64 + off) = __float2half_rn(v[i] - __half2float(h));
        }
    }
    __syncthreads();
}

// How w4_kernel's warps get their tiles. Block ticket (issue 21, fifth pass; passes of 4 and 8
// rows on sm_90): the block's tiles are blockIdx.x + k gridDim.x (k = 0, 1, ...: a balanced share
// of the slot's tiles), warp w starts at k = w and asks the block's shared-memory counter for the
// next k, so a tile costs no global round trip and the block no end-of-pass count (H200, 28672 x
// 8192: M = 1 48.4 -> 46.1 us). Global ticket otherwise: a counter per (slot, super-chunk, pass)
// in global memory shared by the whole grid; it stays in 16- and 32-row passes (16-row passes,
// then one block per SM, lost 1-3 % with the block ticket: the grid cannot even out slower SMs), and on sm_120,
// where the block ticket spilled 24 bytes at w4_kernel<1, false> (and nothing was measured).
__device__ constexpr bool w4_block_ticket(int Q) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
    return false && Q;
#else
    return Q <= 2;
#endif
}

// Bulk L2 prefetch (sm_90 and later): [p, p + bytes) into L2, nothing returned to the SM. p and
// bytes multiples of 16.
__device__ __forceinline__ void l2_prefetch_bulk(const void* p, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// W4Params::prefetch_slot: this block's share (blocks of the slot: gridDim.x x gridDim.y) of the
// expert's matrices (q and s; q3 and s3 with SwiGLU), in 4 KiB requests, a thread's after another's.
template <bool GLU>
__device__ __forceinline__ void w4_prefetch_expert(const W4Params& p) {
    constexpr unsigned kChunk = 4096;
    const unsigned nb = gridDim.x * gridDim.y, b = blockIdx.y * gridDim.x + blockIdx.x;
    const auto region = [&](const void* base, unsigned long bytes) {
        const unsigned long per = (bytes / nb + kChunk - 1) / kChunk * kChunk;  // a multiple of 16
        const unsigned long lo = b * per, hi = lo + per < bytes ? lo + per : bytes;
        for (unsigned long o = lo + threadIdx.x * static_cast<unsigned long>(kChunk); o < hi;
             o += static_cast<unsigned long>(KD_W4_THREADS) * kChunk)
            l2_prefetch_bulk(static_cast<const char*>(base) + o, static_cast<unsigned>(hi - o < kChunk ? hi - o : kChunk));
    };
    const unsigned long qb = static_cast<unsigned long>(p.q_estride) * 4, sb = static_cast<unsigned long>(p.s_estride) * 4;
    region(p.q + p.prefetch_expert * p.q_estride, qb);
    region(p.s + p.prefetch_expert * p.s_estride, sb);
    if (GLU) {
        region(p.q3 + p.prefetch_expert * p.q_estride, qb);
        region(p.s3 + p.prefetch_expert * p.s_estride, sb);
    }
}

// Super-chunks a tile's last warp sums in the streaming launch (2048 x 7168: 7).
constexpr int KD_W4_TAIL_SC = 8;

// The split-K end of a plain tile in the streaming launch (w4_kernel<1, false, true>): after the warp has
// put its values of the tile (token rows [m_begin, m_begin + m_count)) in the workspace it counts
// itself; the last of the tile's n_sc warps writes y = 0 + value_0 + value_1 + ... (ascending), as
// w4_sum_kernel would: the same bits, one launch fewer. Each warp has one tile, so no next tile's
// loads are in flight at the fence (the third MoE pass's fence per tile waited for them).
// Whole warp, uniform arguments.
__device__ __forceinline__ void w4_tail_plain(const W4Params& p, int tile, int m_begin, int m_count, int lane) {
    __threadfence();  // this lane's values before the count (threadFenceReduction's pattern)
    __syncwarp();
    unsigned done = 0;
    if (lane == 0) done = atomicAdd(p.tail_ctr + tile, 1u) + 1;
    if (__shfl_sync(0xffffffffu, done, 0) != static_cast<unsigned>(p.n_sc)) return;
    if (lane == 0) p.tail_ctr[tile] = 0;  // for the next launch (no other warp counts this tile again)
    __threadfence();                      // the other warps' values after their counts
    const int N = p.N, n = tile * w4_tile_outputs(false) + (lane & 15);
    if (n >= N) return;
    // Lane (n, half): token rows half, half + 2, ...; all of a row's loads before its first addition.
    for (int tok = lane >> 4; tok < m_count; tok += 2) {
        const long r = m_begin + tok;
        float v[KD_W4_TAIL_SC];
#pragma unroll
        for (int c = 0; c < KD_W4_TAIL_SC; ++c)
            if (c < p.n_sc) v[c] = __ldcg(p.ws + (c * static_cast<long>(p.M) + r) * N + n);
        float s = 0.0f;
#pragma unroll
        for (int c = 0; c < KD_W4_TAIL_SC; ++c)
            if (c < p.n_sc) s += v[c];
        p.y[r * p.ldy + n] = s;
    }
}

// Blocks per SM that the registers must allow (__launch_bounds__): one from 16 rows up (their 69
// or 137 KiB of staging). Two blocks at 16 rows fit (128 registers, no spills) but were 3-4 %
// slower than one (issue 38's tenth pass: 16 warps per SM instead of 8 issued no faster).
// TAIL: the split-K sum by each tile's last warp (W4Params::tail_ctr), an instantiation of its own
// so that the other launches' code stays as it was (in all of them it took w4_kernel<1, false>
// from 119 to 125 registers and <4, false> from 176 to 180 on sm_90).
template <int Q, bool GLU, bool TAIL = false>
__global__ void __launch_bounds__(KD_W4_THREADS, Q >= 4 ? 1 : 2) w4_kernel(W4Params p) {
    extern __shared__ float4 smem4[];
    unsigned char* bsm = reinterpret_cast<unsigned char*>(smem4);  // [8Q][ROW_BYTES]
    float* xneg = reinterpret_cast<float*>(bsm + 8 * Q * KD_W4_ROW_BYTES);  // [4Q][GROUPS]
    float* fac = xneg + 4 * Q * w4_xstride(Q);                            // [4Q]
    if (static_cast<int>(blockIdx.z) == p.prefetch_slot) w4_prefetch_expert<GLU>(p);
    if (!p.early) chain_acquire();
    chain_release();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    // Read from the block's index, not divided out of one (no division result to keep in a register).
    const int slot = blockIdx.z, sc = blockIdx.y;
    const int N = p.N, K = p.K;
    const uint32_t* qa = p.q;
    const uint32_t* qb = GLU ? p.q3 : p.q;
    const float* sa = p.s;
    const float* sb = GLU ? p.s3 : p.s;
    if (p.slot_expert) {
        if (slot >= *p.n_active) return;  // the whole block
        const long e = p.slot_expert[slot];
        qa += e * p.q_estride;
        qb += e * p.q_estride;
        sa += e * p.s_estride;
        sb += e * p.s_estride;
    }
    // The slot's rows again where a pass needs them, read anew (asm volatile loads are not
    // merged with the first ones): nothing of the pass loop but m_begin stays in registers
    // across the tile loop (fewer registers: 131-136 instead of 174-192 at Q = 4 on sm_90).
    const auto slot_range = [&]() {
        if (!p.slot_expert) return make_int2(0, p.M);
        int b, e, sl = slot;
        asm volatile("mov.b32 %0, %0;" : "+r"(sl));  // the address made anew, not kept
        asm volatile("ld.global.s32 %0, [%1];" : "=r"(b) : "l"(p.slot_start + sl));
        asm volatile("ld.global.s32 %0, [%1];" : "=r"(e) : "l"(p.slot_start + sl + 1));
        return make_int2(b, e);
    };
    if (const int2 r = slot_range(); r.y - r.x > 4 * Q * p.max_passes) {  // outside the contract: a row lists one expert twice
        if (threadIdx.x == 0)
            printf("w4_kernel: slot %d has %d token rows, more than the launch's %d (an expert listed twice for one row?)\n",
                   slot, r.y - r.x, 4 * Q * p.max_passes);
        __trap();
    }
    // The pass's token rows [m_begin, m_begin + m_count), its counters and its number.
    int m_begin = slot_range().x, m_count = 0, pass = 0;
    unsigned* ctr = nullptr;           // global ticket
    __shared__ unsigned block_ctr;     // block ticket: the next k
    constexpr bool BT = w4_block_ticket(Q);
    const int kb = sc * p.sc_len, klen = min(p.sc_len, K - kb), n_groups = klen / 32;

    constexpr int TILE = w4_tile_outputs(GLU);
    const int n_tiles = (N + TILE - 1) / TILE;
    const int n_steps = (n_groups + KD_W4_STEP - 1) / KD_W4_STEP;
    const int NW = GLU ? 2 * N : N;  // workspace columns
    // The lane's half-tiles of tile `tile` (w1 and w3 of its 8 rows with SwiGLU; its two halves
    // else) at the block's first step, in the tiled layout: [N / 8][steps][64 uint4] words,
    // [N / 8][steps][32 float2] scales.
    const int k_steps = (K + 32 * KD_W4_STEP - 1) / (32 * KD_W4_STEP), n_halves = (N + 7) / 8;
    const auto tile_rows = [&](int tile) {
        const long ha = GLU ? tile : 2 * tile, hb = GLU ? tile : min(2 * tile + 1, n_halves - 1);  // a missing half is never stored
        const long first = sc * (p.sc_len / 32 / KD_W4_STEP);
        return W4Rows{reinterpret_cast<const uint4*>(qa) + (ha * k_steps + first) * 64 + lane,
                      reinterpret_cast<const uint4*>(qb) + (hb * k_steps + first) * 64 + lane,
                      reinterpret_cast<const float2*>(sa) + (ha * k_steps + first) * 32 + lane,
                      reinterpret_cast<const float2*>(sb) + (hb * k_steps + first) * 32 + lane};
    };
    // The output row of a lane's value h (0: row g or w1, 1: row g + 8 or w3) and its workspace column.
    const auto out_row = [&](int n0, int h) { return GLU ? n0 + g : n0 + g + 8 * h; };
    const auto ws_col = [&](int n0, int h) { return out_row(n0, h) + (GLU && h ? N : 0); };
    const auto store = [&](int n0, int tok, float v0, float v1) {
        const long prow = m_begin + tok;
        float* yr = p.y + (p.row_out ? p.row_out[prow] : prow) * p.ldy;
        if (GLU) {
            if (out_row(n0, 0) < N) yr[out_row(n0, 0)] = silu_mul_f(v0, v1);
        } else {
            if (out_row(n0, 0) < N) yr[out_row(n0, 0)] = v0;
            if (out_row(n0, 1) < N) yr[out_row(n0, 1)] = v1;
        }
    };
    // The tile's super-chunk values: stored, or (more super-chunks) put in the workspace with
    // plain stores (no fence, no count: w4_sum_kernel, the next launch, adds them; TAIL: the
    // tile's last warp, after a fence and a count).
    const auto finish = [&](int tile, const float (&part)[Q][2]) {
        const int n0 = tile * TILE;
        if (p.n_sc == 1) {
#pragma unroll
            for (int q = 0; q < Q; ++q)
                if (4 * q + t < m_count) store(n0, 4 * q + t, part[q][0] * fac[4 * q + t], part[q][1] * fac[4 * q + t]);
            return;
        }
#pragma unroll
        for (int q = 0; q < Q; ++q) {
            const int tok = 4 * q + t;
            if (tok >= m_count) continue;
            // A 32-bit index (the workspace holds far fewer than 2^32 floats): no 64-bit
            // product to keep across the tile loop.
            float* wr = p.ws + static_cast<unsigned>(sc * p.M + m_begin + tok) * static_cast<unsigned>(NW);
#pragma unroll
            for (int h = 0; h < 2; ++h)
                if (out_row(n0, h) < N) wr[ws_col(n0, h)] = part[q][h] * fac[tok];
        }
        if constexpr (TAIL) w4_tail_plain(p, tile, m_begin, m_count, lane);
    };

    // A warp's first tile is its place in the wave (global ticket) or in the block's share (block
    // ticket); then it asks the counter (which counts from there) when it starts a tile and reads
    // the answer at the tile's last step.
    const int wave_tiles = gridDim.x * KD_W4_WARPS;
    // 16 rows' worth below 8 quads (the shared memory of the 4- to 16-row passes as before the
    // 32-row passes came).
    __shared__ float pmax[(4 * Q > KD_W4_GROUPED_ROWS ? 4 * Q : KD_W4_GROUPED_ROWS) * KD_W4_WARPS];
    // A warp's place in the weights: W4Rows (four pointers), or at one token quad two 32-bit
    // indices of its half-tiles' first steps in the layout's [N / 8][steps] order, from which
    // each fetch makes its addresses: fewer registers.
    constexpr bool IDX = w4_full_steps_here(Q);
    W4Rows rows{};
    unsigned ha = 0, hb = 0;
    const unsigned first = sc * (p.sc_len / 32 / KD_W4_STEP);
    const auto set_tile = [&](int tl) {
        if constexpr (IDX) {
            ha = static_cast<unsigned>(GLU ? tl : 2 * tl) * k_steps + first;
            hb = static_cast<unsigned>(GLU ? tl : min(2 * tl + 1, n_halves - 1)) * k_steps + first;
        } else {
            rows = tile_rows(tl);
        }
    };
    const auto fetch = [&](int step, auto guarded) {
        constexpr bool G = decltype(guarded)::value;
        if constexpr (IDX) {
            W4Step f;
            // 32-bit offsets (the layout of one matrix stays under 2^32 uint4s): the base
            // pointers stay uniform, nothing per lane is 64-bit.
            const unsigned oa = (ha + step) * 64u + lane, ob = (hb + step) * 64u + lane;
            const uint4* pa = reinterpret_cast<const uint4*>(qa) + oa;
            const uint4* pb = reinterpret_cast<const uint4*>(qb) + ob;
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                f.wa[j] = G ? ld_stream_guarded(pa + 32 * j) : ld_stream(pa + 32 * j);
                f.wb[j] = G ? ld_stream_guarded(pb + 32 * j) : ld_stream(pb + 32 * j);
            }
            f.sa = __ldg(reinterpret_cast<const float2*>(sa) + ((ha + step) * 32u + lane));
            f.sb = __ldg(reinterpret_cast<const float2*>(sb) + ((hb + step) * 32u + lane));
            return f;
        } else {
            return w4_fetch<G>(rows, step);
        }
    };
    for (;; m_begin += 4 * Q) {  // token rows 4Q at a time; the block stays together
        {
            const int2 range = slot_range();
            if (m_begin >= range.y) break;  // (uniform)
            pass = (m_begin - range.x) / (4 * Q);
            m_count = min(4 * Q, range.y - m_begin);
        }
        if constexpr (BT) {
            if (threadIdx.x == 0) block_ctr = KD_W4_WARPS;  // read after w4_stage's barriers
        } else {
            ctr = p.sched + 2 * ((slot * p.n_sc + sc) * p.max_passes + pass);  // a few thousand counters at most
        }
        int tile = BT ? blockIdx.x + warp * gridDim.x : blockIdx.x * KD_W4_WARPS + warp;
        // Made opaque at one token quad, so the first fetch's addresses are computed in each pass
        // rather than hoisted out of the pass loop and kept (spilled) across the tile loop.
        if constexpr (IDX) asm volatile("mov.b32 %0, %0;" : "+r"(tile));
        // The first fetch is guarded (volatile asm): ld_stream is an asm the compiler may hoist
        // above the `tile < n_tiles` test, and did at Q = 4 once the split-K count was gone
        // (compute-sanitizer saw reads past the weights). Fetching unconditionally instead cost
        // 4 registers and 5-10 % at M = 1 to 4 on the H200; clamping the rows of a warp without
        // a tile spilled on sm_120.
        W4Step cur{}, other{};
        bool primed = false;  // `other` holds the tile's step 1 already
        if (tile < n_tiles) {
            set_tile(tile);
            cur = fetch(0, std::true_type{});
            if (n_steps > 1) {
                other = fetch(1, std::true_type{});
                primed = true;
            }
        }
        // The first two steps are on their way while the activations are staged (with one, the
        // warps' loads in flight ran out during the staging: 28672 x 8192 at M = 1 42.7 -> 41.8
        // us, M = 16 123 -> 105 us, issue 21's eighth pass).
        if (p.early) chain_acquire();  // (a no-op after the first pass)
        w4_stage<Q>(p, m_begin, m_count, kb, klen, bsm, xneg, fac, pmax);
        // Full steps only (the common case, K a multiple of 256 in this super-chunk): the steps
        // without per-group tests where w4_full_steps_here(Q); otherwise all of them with the tests.
        const auto run_tiles = [&](auto full) {
            constexpr bool FULL = decltype(full)::value;
            while (tile < n_tiles) {
                int ticket = 0;
                if (lane == 0)
                    ticket = BT ? static_cast<int>(blockIdx.x + atomicAdd(&block_ctr, 1u) * gridDim.x)
                                : static_cast<int>(atomicAdd(ctr, 1u)) + wave_tiles;
                int next = 0;
                float part[Q][2];
#pragma unroll
                for (int q = 0; q < Q; ++q) part[q][0] = part[q][1] = 0.0f;
                const auto next_rows = [&]() {
                    next = __shfl_sync(0xffffffffu, ticket, 0);
                    set_tile(next < n_tiles ? next : tile);
                };
                // Two steps per iteration with two register buffers: while one step computes, the
                // next one (of this tile or the next) is loading. After the last tile the warp
                // re-reads its tile's first step (never used), so every fetch is unconditional but
                // the pass's first, which `primed` says was made before the staging.
                for (int st = 0; st < n_steps; st += 2) {
                    const bool last_a = st + 1 >= n_steps;
                    if (last_a) next_rows();
                    if (!primed) other = fetch(last_a ? 0 : st + 1, std::false_type{});
                    primed = false;
                    w4_step<Q, FULL>(part, cur, st, n_groups, bsm, xneg, m_count, lane);
                    if (last_a) {  // odd step count: the next tile starts in `other`
                        cur = other;
                        break;
                    }
                    const bool last_b = st + 2 >= n_steps;
                    if (last_b) next_rows();
                    cur = fetch(last_b ? 0 : st + 2, std::false_type{});
                    w4_step<Q, FULL>(part, other, st + 1, n_groups, bsm, xneg, m_count, lane);
                }
                finish(tile, part);
                tile = next;
            }
        };
        if (w4_full_steps_here(Q) && n_groups % KD_W4_STEP == 0) run_tiles(std::true_type{});
        else run_tiles(std::false_type{});
        if constexpr (BT) __syncthreads();  // frees the staged rows and the counter for the next pass
        else sched_block_done(ctr);         // its barrier also frees the staged rows for the next pass
    }
}


// Split-K (n_sc > 1), launched after w4_kernel by launch_chained: y = 0 + value_0 + value_1 + ...
// (the super-chunks' values in the workspace, ascending), SwiGLU applied with it; a thread per
// (row, output). Its griddepcontrol.wait (chain_acquire) returns once w4_kernel has finished and
// its stores are visible, so the streaming kernel stores its values with no fence and no count.
// Grouped: the rows are the slots' pairs [0, slot_start[*n_active]); y row row_out[p] (null: p).
// B > 1 (W4Params::sum_together): a thread's values B at a time, the slot count and the output row
// beside them, all in flight before the first addition (every row < M has its workspace row and
// list entry); B = 1: each value after the last, the row count first. The same additions in the
// same order either way. B = 1 keeps the one-after-another code as it was, not as B > 1 with a
// batch of one: that form compiled differently and was slower at 4 tokens and on the plain
// matmul (issue 38's fourth MoE pass, call 3).
constexpr int KD_W4_SUM_BATCH = 8;

template <bool GLU, int B>
__global__ void w4_sum_kernel(W4Params p) {
    chain_acquire();
    chain_release();
    const int N = p.N, NW = GLU ? 2 * N : N;
    const long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x;
    if constexpr (B == 1) {
        const int rows = p.slot_expert ? p.slot_start[*p.n_active] : p.M;
        if (i >= static_cast<long>(rows) * N) return;
        const int prow = static_cast<int>(i / N), n = static_cast<int>(i % N);
        float v0 = 0.0f, v1 = 0.0f;
        for (int c = 0; c < p.n_sc; ++c) {
            const float* wr = p.ws + (static_cast<long>(c) * p.M + prow) * NW;
            v0 += __ldcg(wr + n);
            if (GLU) v1 += __ldcg(wr + N + n);
        }
        float* yr = p.y + (p.row_out ? p.row_out[prow] : prow) * p.ldy;
        yr[n] = GLU ? silu_mul_f(v0, v1) : v0;
    } else {
        if (i >= static_cast<long>(p.M) * N) return;
        const int prow = static_cast<int>(i / N), n = static_cast<int>(i % N);
        const int n_active = p.slot_expert ? __ldcg(p.n_active) : 0;
        const long yrow = p.row_out ? __ldcg(p.row_out + prow) : prow;
        const float* wr = p.ws + static_cast<long>(prow) * NW + n;
        const long c_stride = static_cast<long>(p.M) * NW;
        float v0 = 0.0f, v1 = 0.0f;
        for (int c0 = 0; c0 < p.n_sc; c0 += B) {
            float a[B], b[B];
#pragma unroll
            for (int j = 0; j < B; ++j)
                if (c0 + j < p.n_sc) {
                    a[j] = __ldcg(wr + (c0 + j) * c_stride);
                    if (GLU) b[j] = __ldcg(wr + (c0 + j) * c_stride + N);
                }
#pragma unroll
            for (int j = 0; j < B; ++j)
                if (c0 + j < p.n_sc) {
                    v0 += a[j];
                    if (GLU) v1 += b[j];
                }
        }
        if (p.slot_expert && prow >= __ldcg(p.slot_start + n_active)) return;
        p.y[yrow * p.ldy + n] = GLU ? silu_mul_f(v0, v1) : v0;
    }
}

// Dynamic shared memory of w4_kernel<Q>: 8 Q staged B rows and 4 Q activation rows
// (Q = 8: 137 KiB, Q = 4: 69 KiB, Q = 2: 34 KiB, Q = 1: 17 KiB).
constexpr int w4_smem_bytes(int Q) {
    return 8 * Q * KD_W4_ROW_BYTES + static_cast<int>(sizeof(float)) * 4 * Q * (w4_xstride(Q) + 1);
}

// The super-chunk length forced for every shape (a measurement knob: 256 or 512 from
// KD_W4_SCHUNK, or set by bench tools between calls; 0, the default: KD_W4_SCHUNK).
inline int& w4_schunk_override() {
    static int v = [] {
        const char* e = std::getenv("KD_W4_SCHUNK");
        const int n = e ? std::atoi(e) : 0;
        return n == 256 || n == 512 || n == KD_W4_SCHUNK ? n : 0;
    }();
    return v;
}

// Inputs per super-chunk: KD_W4_SCHUNK for every shape unless the knob forces another. Shorter
// ones for the K2 expert's shapes (issue 38's ninth pass, H100, one process): 256 made the plain
// 2048 x 7168 and 7168 x 2048 matmuls up to 10 % faster, but 512 made the MoE layer, whose
// grouped launches run the same shapes, 2-2.5 % slower (more super-chunk sums). A row's bits
// depend on the length, so the plain and grouped launches of a shape must share it (the shared
// expert runs in either): a rule may depend on the shape alone, never on M, the pass or grouping.
inline int w4_schunk() {
    const int o = w4_schunk_override();
    return o ? o : KD_W4_SCHUNK;
}

// Launches w4_kernel<Q, GLU> (w4_kernel<1, false, true> where p.tail_ctr is set and every warp has
// one tile); true where its tiles' last warps sum the super-chunks.
template <int Q, bool GLU>
bool w4_launch_q(W4Params p, int slots, int num_sms, cudaStream_t stream) {
    const int smem = w4_smem_bytes(Q);
    static bool configured = false;  // one attribute call per instantiation
    if (!configured) {
        KD_CUDA_CHECK(cudaFuncSetAttribute(w4_kernel<Q, GLU>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        if constexpr (Q == 1 && !GLU)
            KD_CUDA_CHECK(cudaFuncSetAttribute(w4_kernel<1, false, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        configured = true;
    }
    int per_sm = 0;
    KD_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, w4_kernel<Q, GLU>, KD_W4_THREADS, smem));
    const int pairs = slots * p.n_sc;
    const int tiles = ceil_div(p.N, w4_tile_outputs(GLU));
    // One resident wave shared among the (slot, super-chunk) pairs, no more warps than tiles.
    const int grid_x = std::max(1, std::min(std::max(1, per_sm) * num_sms / pairs, ceil_div(tiles, KD_W4_WARPS)));
    const dim3 grid(grid_x, p.n_sc, slots);
    // A warp with two tiles would fence over the next one's loads (issue 38's third MoE pass).
    if constexpr (Q == 1 && !GLU) {
        if (p.tail_ctr && grid_x * KD_W4_WARPS >= tiles) {
            launch_chained("w4_kernel launch", w4_kernel<1, false, true>, grid, dim3(KD_W4_THREADS), smem, stream, p);
            return true;
        }
    }
    launch_chained("w4_kernel launch", w4_kernel<Q, GLU>, grid, dim3(KD_W4_THREADS), smem, stream, p);
    return false;
}

// Launches w4_kernel for `slots` slots (1 when plain) of at most max_rows token rows each
// (KD_W4_MAX_ROWS plain, KD_W4_GROUPED_ROWS grouped or with SwiGLU), in passes of pass_rows rows
// (rounded up to 4, 8, 16 or 32; the result does not depend on it). The caller has set the
// weights, rows, shape and (grouped) the slot lists.
template <bool GLU>
void w4_run(Context& ctx, W4Params p, int max_rows, int pass_rows, int slots) {
    // 32-row passes for plain launches only: the weights are read once for 32 rows, and
    // w4_kernel<8, true> is never compiled (moe_ffn's launches take at most 16 rows a slot).
    const int max_quads = GLU || p.slot_expert ? KD_W4_GROUPED_ROWS / 4 : KD_W4_MAX_ROWS / 4;
    const int quads = std::min(max_quads, ceil_div(std::min(pass_rows, max_rows), 4));
    int q = quads <= 1 ? 1 : quads == 2 ? 2 : quads <= 4 ? 4 : 8;
    // A device that gives a block less shared memory than a pass needs takes passes of half the
    // rows, which give the same bits (rows never depend on the pass size).
    while (q > 2 && w4_smem_bytes(q) > device_smem_optin()) q /= 2;
    p.sc_len = w4_schunk();
    p.n_sc = ceil_div(p.K, p.sc_len);
    p.max_passes = ceil_div(max_rows, 4 * q);
    if (p.n_sc > 1) {
        p.ws = ctx.split_ws.get<float>(static_cast<size_t>(p.n_sc) * p.M * (GLU ? 2 : 1) * p.N);
    }
    p.sched = ctx.sched.get<unsigned>(2 * static_cast<size_t>(slots) * p.n_sc * p.max_passes);
    // One pass of one quad only: with two passes a tile's counts could interleave, and from 8 rows
    // the last warp's sum, two rows at a time, cost more than the launch (issue 38's thirteenth pass).
    if (!GLU && !p.slot_expert && q == 1 && p.n_sc > 1 && p.n_sc <= KD_W4_TAIL_SC && p.max_passes == 1)
        p.tail_ctr = ctx.split_counters.get<unsigned>(static_cast<size_t>(ceil_div(p.N, w4_tile_outputs(false))));
    bool tailed = false;
    if (q == 1) tailed = w4_launch_q<1, GLU>(p, slots, ctx.num_sms, ctx.stream);
    else if (q == 2) tailed = w4_launch_q<2, GLU>(p, slots, ctx.num_sms, ctx.stream);
    else if (GLU || q == 4) tailed = w4_launch_q<4, GLU>(p, slots, ctx.num_sms, ctx.stream);
    else if constexpr (!GLU) tailed = w4_launch_q<8, false>(p, slots, ctx.num_sms, ctx.stream);
    if (p.n_sc > 1 && !tailed) {
        const long n = static_cast<long>(p.M) * p.N;
        const auto sum = p.sum_together ? w4_sum_kernel<GLU, KD_W4_SUM_BATCH> : w4_sum_kernel<GLU, 1>;
        launch_chained("w4_sum_kernel launch", sum, dim3(ceil_div(n, 256)), dim3(256), 0, ctx.stream, p);
    }
}

// Instantiated once, in matmul_w4a16.cu: moe_ffn.cu uses both without compiling the kernels again.
extern template void w4_run<false>(Context&, W4Params, int, int, int);
extern template void w4_run<true>(Context&, W4Params, int, int, int);

}  // namespace kd::cuda
