"""DeepSeek-V3 (and Kimi-K2) style decoder, NumPy float64 reference: the engine's ground truth.

The math is engine_src/README.md's "The model" section, which follows DeepSeek-V3's published
inference code: MLA attention with decoupled RoPE dims, absorbed over a latent cache (c, roped
k), RMSNorm, first dense SwiGLU layer(s), then MoE layers with sigmoid gating, a correction
bias, group-limited top-k routing, weights normalised and scaled by route_scale, and a shared
expert. Weights are given as float32 arrays (dequantized ones for INT4 bundles) and computed
in float64, so the reference is far more accurate than the FP32 engine it checks (a float32
instance exists to show that FP32 rounding leaves the golden tokens alone).

`Transformer.forward` is the one general forward: a batch of sequences, N new tokens each at
given positions, a visibility mask over the cache; prefill, AR decode and tree verification
all use it. RoPE may be scaled with YaRN as DeepSeek-V3 and Kimi-K2 do (`RopeScaling`, the
`rope_scaling` object of their Hugging Face configs, with the same semantics).
`Transformer.forward_full` is the cacheless, non-absorbed textbook form, kept only to check the
absorbed path.
"""

import math
from dataclasses import asdict, dataclass, fields

import numpy as np


@dataclass(frozen=True)
class RopeScaling:
    """YaRN RoPE scaling: the `rope_scaling` object of a DeepSeek-V3 / Kimi-K2 Hugging Face config
    (DeepSeek-V3: factor 40, original context 4096, beta_fast 32, beta_slow 1, mscale 1, mscale_all_dim 1)."""

    type: str = "yarn"                          # the only scaling this reference knows
    factor: float = 1.0                         # context extension factor s
    original_max_position_embeddings: int = 0   # the context the model was pretrained at (required)
    beta_fast: float = 32.0                     # rotations per original context above which a pair is kept
    beta_slow: float = 1.0                      # ... below which a pair is interpolated (divided by s);
                                                # equal to beta_fast (Kimi-K2: both 1) is allowed
    mscale: float = 1.0                         # cos/sin scale yarn_mscale(s, mscale) / yarn_mscale(s, mscale_all_dim)
    mscale_all_dim: float = 0.0                 # softmax scale times yarn_mscale(s, mscale_all_dim)^2 (0: none)

    def __post_init__(self):
        if self.type != "yarn":
            raise ValueError(f"rope_scaling: unknown type {self.type!r} (this reference knows 'yarn')")
        if not self.factor >= 1 or self.original_max_position_embeddings <= 0 or not self.beta_fast >= self.beta_slow > 0:
            raise ValueError(f"rope_scaling: need factor >= 1, original_max_position_embeddings > 0 and "
                             f"beta_fast >= beta_slow > 0, got {self}")


@dataclass(frozen=True)
class ModelArgs:
    """Model configuration; the `config` object of a bundle header has exactly these fields."""

    name: str = "tiny"              # config name, e.g. tiny, tiny2
    vocab_size: int = 400           # V: tokens are 0..V-1
    dim: int = 192                  # h: hidden size of the residual stream
    n_layers: int = 6               # transformer blocks
    n_dense_layers: int = 1         # the first blocks use a dense SwiGLU FFN, the rest MoE
    n_heads: int = 4                # H: attention heads
    q_lora_rank: int = 96           # d_q: query low-rank dim; 0 means a plain wq
    kv_lora_rank: int = 64          # d_c: the latent cached per token and layer
    qk_nope_head_dim: int = 32      # d_n: per-head query/key dims without RoPE
    qk_rope_head_dim: int = 16      # d_r: RoPE dims; one roped key shared by all heads
    v_head_dim: int = 32            # d_v: per-head value dim
    inter_dim: int = 384            # dense FFN width
    moe_inter_dim: int = 96         # routed expert width
    n_routed_experts: int = 8       # E
    n_shared_experts: int = 1       # shared expert width = n_shared_experts * moe_inter_dim
    n_activated_experts: int = 2    # top-k experts per token
    n_expert_groups: int = 1        # routing groups (experts split evenly, in index order)
    n_limited_groups: int = 1       # groups kept per token (topk_group)
    route_scale: float = 1.0        # routed_scaling_factor applied to the normalised weights
    rope_theta: float = 10000.0     # RoPE base
    rope_scaling: RopeScaling | None = None  # YaRN; None: plain RoPE (and absent from the header)
    norm_eps: float = 1e-6          # RMSNorm epsilon
    max_seq_len: int = 256          # cache capacity in committed tokens

    def to_json(self) -> dict:
        """The config as a header object (field order as declared; no rope_scaling key when None,
        so a config without scaling writes the same header as before the field existed)."""
        config = asdict(self)
        if self.rope_scaling is None:
            del config["rope_scaling"]
        return config

    @classmethod
    def from_json(cls, config: dict) -> "ModelArgs":
        """The config of a header object; a ValueError names an unknown or bad field."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(config) - names)
        if unknown:
            raise ValueError(f"config: unknown field {unknown[0]!r}")
        scaling = config.get("rope_scaling")
        if scaling is not None:
            bad = sorted(set(scaling) - {f.name for f in fields(RopeScaling)}) if isinstance(scaling, dict) else [scaling]
            if bad:
                raise ValueError(f"config.rope_scaling: unknown field {bad[0]!r}")
            scaling = RopeScaling(**scaling)
        return cls(**{**config, "rope_scaling": scaling})


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's magnitude term 0.1 mscale ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_correction_range(args: ModelArgs) -> tuple[int, int]:
    """The pair indices [low, high] between which YaRN ramps from kept to interpolated frequencies:
    the pairs that turn beta_fast and beta_slow times over the original context, floored and ceiled."""
    s, d = args.rope_scaling, args.qk_rope_head_dim

    def pair(rotations):
        return d * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(args.rope_theta))

    return max(math.floor(pair(s.beta_fast)), 0), min(math.ceil(pair(s.beta_slow)), d - 1)


def linear_ramp(low: float, high: float, n: int) -> np.ndarray:
    """YaRN's ramp over pairs 0..n-1: 0 up to `low`, 1 from `high` on, linear in between. Equal ends
    (Kimi-K2's beta_fast == beta_slow, or both clamped to one end) are handled as DeepSeek-V3's and
    Kimi-K2's reference code does (linear_ramp_factor / yarn_linear_ramp_mask: high += 0.001), a
    step at `low`."""
    if low == high:
        high += 0.001
    return np.clip((np.arange(n, dtype=np.float64) - low) / (high - low), 0.0, 1.0)


def rope_frequencies(args: ModelArgs) -> tuple[np.ndarray, float]:
    """(inv_freq [d_r/2], magnitude): pair i at position p turns by p inv_freq[i], and cos/sin are
    multiplied by magnitude. Plain RoPE: theta^(-2i/d_r) and 1. YaRN: pairs below the ramp keep
    theta^(-2i/d_r), pairs above it are divided by the factor, linear in between."""
    d = args.qk_rope_head_dim
    extra = args.rope_theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    s = args.rope_scaling
    if s is None:
        return extra, 1.0
    low, high = yarn_correction_range(args)
    ramp = linear_ramp(low, high, d // 2)
    inv_freq = extra / s.factor * ramp + extra * (1.0 - ramp)
    return inv_freq, yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)


def softmax_scale(args: ModelArgs) -> float:
    """tau = (d_n + d_r)^-1/2, times yarn_mscale(factor, mscale_all_dim)^2 with YaRN (DeepSeek-V3's
    correction for the attention entropy at the extended context; none when mscale_all_dim is 0)."""
    tau = (args.qk_nope_head_dim + args.qk_rope_head_dim) ** -0.5
    s = args.rope_scaling
    if s is not None and s.mscale_all_dim:
        tau *= yarn_mscale(s.factor, s.mscale_all_dim) ** 2
    return tau


def rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, magnitude: float = 1.0) -> np.ndarray:
    """Rotate adjacent pairs (x_2i, x_2i+1) of x [..., N, d_r] by positions [N] * inv_freq[i],
    with cos and sin times magnitude (rope_frequencies)."""
    angle = positions.astype(np.float64)[:, None] * inv_freq
    cos, sin = (np.cos(angle) * magnitude).astype(x.dtype), (np.sin(angle) * magnitude).astype(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def swiglu(x: np.ndarray, w1t: np.ndarray, w2t: np.ndarray, w3t: np.ndarray) -> np.ndarray:
    """w2 (silu(w1 x) * (w3 x)) for rows of x, given the transposed weights w.T."""
    return (silu(x @ w1t) * (x @ w3t)) @ w2t


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis; -inf entries get exactly zero weight."""
    e = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return e / np.sum(e, axis=-1, keepdims=True)


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Log-softmax over the last axis."""
    shifted = x - np.max(x, axis=-1, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def top_margin(x: np.ndarray) -> np.ndarray:
    """Top-1 minus top-2 value over the last axis: how far an argmax is from a tie."""
    part = -np.partition(-x, 1, axis=-1)
    return part[..., 0] - part[..., 1]


def stable_topk(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values per row, largest first; ties go to the lower index."""
    return np.argsort(-x, axis=-1, kind="stable")[..., :k]


class KVCache:
    """The latent cache of a batch of sequences: per layer c [B][cap][d_c] and roped k [B][cap][d_r].

    Rows [0, length) are committed. A forward writes its new rows at [length, length + N)
    and leaves `length` alone: the caller commits (AR) or compacts (tree verify).
    """

    def __init__(self, args: ModelArgs, batch: int = 1, capacity: int | None = None, dtype=np.float64):
        cap = capacity or args.max_seq_len
        self.c = np.zeros((args.n_layers, batch, cap, args.kv_lora_rank), dtype=dtype)
        self.k = np.zeros((args.n_layers, batch, cap, args.qk_rope_head_dim), dtype=dtype)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.c.shape[2]


@dataclass
class ForwardOut:
    """What a forward returns for a batch of B sequences with N new tokens each."""

    logits: np.ndarray       # [B][N][V]
    hidden: np.ndarray       # [B][N][h], after the final RMSNorm (the drafter's h_T)
    route_margin: np.ndarray  # [B][N] min over MoE layers of k-th minus (k+1)-th selection score
    group_margin: np.ndarray  # [B][N] min over MoE layers of last kept minus first dropped group score


class Transformer:
    """The reference model over float32 weights (README tensor names), computed in float64
    (or in float32 with dtype=np.float32, to measure what FP32 rounding does)."""

    def __init__(self, args: ModelArgs, weights: dict[str, np.ndarray], dtype=np.float64):
        self.args = args
        self.dtype = dtype
        self.w = {name: np.asarray(value, dtype=dtype) for name, value in weights.items()}
        # y = W x on rows is x @ W.T; a contiguous copy of W.T makes those products twice as fast
        self.wt = {name: np.ascontiguousarray(value.T) for name, value in self.w.items() if value.ndim == 2}
        self.rope_freq, self.rope_magnitude = rope_frequencies(args)
        self.tau = softmax_scale(args)

    def _rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        return rope(x, positions, self.rope_freq, self.rope_magnitude)

    def _swiglu(self, prefix: str, x: np.ndarray) -> np.ndarray:
        """The SwiGLU FFN `prefix` (w1, w2, w3: a dense FFN, an expert, the shared expert) on rows x."""
        return swiglu(x, self.wt[prefix + "w1"], self.wt[prefix + "w2"], self.wt[prefix + "w3"])

    def embed_rows(self, tokens: np.ndarray) -> np.ndarray:
        """The embedding rows of tokens (any shape), [..., h]."""
        return self.w["embed"][tokens]

    def head_logits(self, hidden: np.ndarray) -> np.ndarray:
        """The logits [..., V] of final-normed states [..., h]."""
        return hidden @ self.wt["head"]

    # ---- building blocks -------------------------------------------------------------

    def _query(self, prefix: str, x: np.ndarray) -> np.ndarray:
        """Per-head queries [..., H, d_n + d_r] of rows x [..., h]."""
        a, w = self.args, self.w
        if a.q_lora_rank:
            cq = rms_norm(x @ self.wt[prefix + "wq_a"], w[prefix + "q_norm"], a.norm_eps)
            q = cq @ self.wt[prefix + "wq_b"]
        else:
            q = x @ self.wt[prefix + "wq"]
        return q.reshape(*x.shape[:-1], a.n_heads, a.qk_nope_head_dim + a.qk_rope_head_dim)

    def _latent(self, prefix: str, x: np.ndarray, positions: np.ndarray):
        """The cache rows of x [B][N][h]: c [B][N][d_c] and roped k [B][N][d_r]."""
        a, w = self.args, self.w
        kv = x @ self.wt[prefix + "wkv_a"]
        c = rms_norm(kv[..., :a.kv_lora_rank], w[prefix + "kv_norm"], a.norm_eps)
        k_rope = self._rope(kv[..., a.kv_lora_rank:], positions)
        return c, k_rope

    def _split_wkv_b(self, prefix: str):
        """W_UK [H][d_n][d_c] and W_UV [H][d_v][d_c] from wkv_b."""
        a = self.args
        wkv_b = self.w[prefix + "wkv_b"].reshape(a.n_heads, a.qk_nope_head_dim + a.v_head_dim,
                                                 a.kv_lora_rank)
        return wkv_b[:, :a.qk_nope_head_dim], wkv_b[:, a.qk_nope_head_dim:]

    def _mla(self, layer: int, x: np.ndarray, positions: np.ndarray, mask: np.ndarray,
             cache: KVCache) -> np.ndarray:
        """Absorbed MLA over the cache; writes x's rows at [cache.length, cache.length + N)."""
        a = self.args
        prefix = f"layers.{layer}.attn."
        start, n = cache.length, x.shape[1]
        # heads-first layout [B][H][N][.] so every product below is a batched matmul
        q = self._query(prefix, x).transpose(0, 2, 1, 3)            # [B][H][N][d_n+d_r]
        q_nope = q[..., :a.qk_nope_head_dim]
        q_rope = self._rope(q[..., a.qk_nope_head_dim:], positions)
        c_new, k_new = self._latent(prefix, x, positions)
        cache.c[layer, :, start:start + n] = c_new
        cache.k[layer, :, start:start + n] = k_new
        c_all, k_all = cache.c[layer, :, :start + n], cache.k[layer, :, :start + n]
        w_uk, w_uv = self._split_wkv_b(prefix)
        q_hat = q_nope @ w_uk[None]                                  # W_UK^T q_nope: [B][H][N][d_c]
        tau = self.tau
        b, h, t = x.shape[0], a.n_heads, start + n
        # all heads share the cache rows: fold them into the query rows, one matmul per sequence
        scores = tau * (q_hat.reshape(b, h * n, -1) @ c_all.swapaxes(1, 2)
                        + q_rope.reshape(b, h * n, -1) @ k_all.swapaxes(1, 2)).reshape(b, h, n, t)
        scores = np.where(mask, scores, -np.inf)                     # invisible rows weigh exactly 0
        latent = (softmax(scores).reshape(b, h * n, t) @ c_all).reshape(b, h, n, -1)
        o = (latent @ w_uv.swapaxes(1, 2)[None]).transpose(0, 2, 1, 3)  # W_UV latent: [B][N][H][d_v]
        return o.reshape(*x.shape[:2], -1) @ self.wt[prefix + "wo"]

    def gate_scores(self, layer: int, x: np.ndarray) -> np.ndarray:
        """Router scores s = sigmoid(gate.weight x) [M][E] of rows x [M][h]."""
        return 1.0 / (1.0 + np.exp(-(x @ self.wt[f"layers.{layer}.ffn.gate.weight"])))

    def route(self, layer: int, x: np.ndarray):
        """MoE routing of rows x [M][h]: (expert ids [M][k], weights [M][k], route and group margins [M])."""
        a, w = self.args, self.w
        prefix = f"layers.{layer}.ffn.gate."
        scores = self.gate_scores(layer, x)
        select = scores + w[prefix + "bias"]                             # s' = s + b
        group_margin = np.full(len(x), np.inf)
        if a.n_expert_groups > a.n_limited_groups:      # else every group is kept: no group choice
            grouped = select.reshape(len(x), a.n_expert_groups, -1)
            group_scores = np.sum(-np.sort(-grouped, axis=-1)[..., :2], axis=-1)
            order = stable_topk(group_scores, a.n_expert_groups)
            kept = order[:, :a.n_limited_groups]
            ranked = np.take_along_axis(group_scores, order, axis=-1)
            group_margin = ranked[:, a.n_limited_groups - 1] - ranked[:, a.n_limited_groups]
            keep = np.zeros((len(x), a.n_expert_groups), dtype=bool)
            np.put_along_axis(keep, kept, True, axis=-1)
            select = np.where(np.repeat(keep, a.n_routed_experts // a.n_expert_groups, axis=-1),
                              select, -np.inf)
        k = a.n_activated_experts
        order = stable_topk(select, k + 1)
        ranked = np.take_along_axis(select, order, axis=-1)
        route_margin = ranked[:, k - 1] - ranked[:, k]
        idx = order[:, :k]
        chosen = np.take_along_axis(scores, idx, axis=-1)
        weights = chosen / np.sum(chosen, axis=-1, keepdims=True) * a.route_scale
        return idx, weights, route_margin, group_margin

    def _moe(self, layer: int, x: np.ndarray):
        """MoE FFN of rows x [M][h]: (y [M][h], route margins [M], group margins [M])."""
        prefix = f"layers.{layer}.ffn."
        idx, weights, route_margin, group_margin = self.route(layer, x)
        y = self._swiglu(prefix + "shared.", x)
        for e in range(self.args.n_routed_experts):
            rows, slot = np.nonzero(idx == e)
            if rows.size:
                out = self._swiglu(f"{prefix}experts.{e}.", x[rows])
                y[rows] += weights[rows, slot][:, None] * out
        return y, route_margin, group_margin

    def _ffn(self, layer: int, x: np.ndarray):
        """Dense or MoE FFN of x [B][N][h], with routing margins [B][N] (inf for dense)."""
        a = self.args
        prefix = f"layers.{layer}.ffn."
        if layer < a.n_dense_layers:
            inf = np.full(x.shape[:2], np.inf)
            return self._swiglu(prefix, x), inf, inf
        y, rm, gm = self._moe(layer, x.reshape(-1, a.dim))
        return y.reshape(x.shape), rm.reshape(x.shape[:2]), gm.reshape(x.shape[:2])

    # ---- forwards --------------------------------------------------------------------

    def forward(self, tokens: np.ndarray, positions: np.ndarray, mask: np.ndarray,
                cache: KVCache) -> ForwardOut:
        """Run N new tokens per sequence (tokens [B][N]) at positions [N] through the model.

        mask [N][cache.length + N] (bool) says which cache rows, committed or new, each new
        token sees; the new tokens' latent rows are written at [cache.length, cache.length + N).
        """
        a, w = self.args, self.w
        tokens = np.asarray(tokens)
        positions = np.asarray(positions)
        if cache.length + tokens.shape[1] > cache.capacity:
            raise ValueError(f"cache overflow: {cache.length} + {tokens.shape[1]} > {cache.capacity}")
        x = self.embed_rows(tokens)
        route_margin = np.full(tokens.shape, np.inf)
        group_margin = np.full(tokens.shape, np.inf)
        for layer in range(a.n_layers):
            lp = f"layers.{layer}."
            x = x + self._mla(layer, rms_norm(x, w[lp + "attn_norm"], a.norm_eps), positions, mask, cache)
            y, rm, gm = self._ffn(layer, rms_norm(x, w[lp + "ffn_norm"], a.norm_eps))
            x = x + y
            route_margin = np.minimum(route_margin, rm)
            group_margin = np.minimum(group_margin, gm)
        hidden = rms_norm(x, w["norm"], a.norm_eps)
        return ForwardOut(self.head_logits(hidden), hidden, route_margin, group_margin)

    def forward_full(self, tokens: np.ndarray) -> np.ndarray:
        """Cacheless causal forward of one sequence (tokens [T]) with the textbook MLA
        (keys and values expanded per head from the latent); returns logits [T][V]."""
        a, w = self.args, self.w
        tokens = np.asarray(tokens)
        t = len(tokens)
        positions = np.arange(t)
        causal = np.tril(np.ones((t, t), dtype=bool))
        tau = self.tau
        x = self.embed_rows(tokens)
        for layer in range(a.n_layers):
            lp = f"layers.{layer}."
            prefix = lp + "attn."
            h = rms_norm(x, w[lp + "attn_norm"], a.norm_eps)
            q = self._query(prefix, h)                                   # [T][H][d_n+d_r]
            q_nope, q_rope = q[..., :a.qk_nope_head_dim], q[..., a.qk_nope_head_dim:]
            q_rope = self._rope(q_rope.swapaxes(0, 1), positions).swapaxes(0, 1)
            c, k_rope = self._latent(prefix, h[None], positions)
            kv = (c[0] @ self.wt[prefix + "wkv_b"]).reshape(t, a.n_heads, -1)
            k_nope, v = kv[..., :a.qk_nope_head_dim], kv[..., a.qk_nope_head_dim:]
            k = np.concatenate([k_nope, np.broadcast_to(k_rope[0][:, None], (t, a.n_heads, a.qk_rope_head_dim))], -1)
            qf = np.concatenate([q_nope, q_rope], -1)
            scores = tau * np.einsum("shd,thd->hst", qf, k)
            probs = softmax(np.where(causal, scores, -np.inf))
            o = np.einsum("hst,thv->shv", probs, v).reshape(t, -1)
            x = x + o @ self.wt[prefix + "wo"]
            y, _, _ = self._ffn(layer, rms_norm(x, w[lp + "ffn_norm"], a.norm_eps)[None])
            x = x + y[0]
        return self.head_logits(rms_norm(x, w["norm"], a.norm_eps))


def prefill(model: Transformer, prompts: np.ndarray, cache: KVCache) -> ForwardOut:
    """Run prompts [B][P] causally from position cache.length and commit them."""
    n = prompts.shape[1]
    start = cache.length
    mask = np.tri(n, start + n, start, dtype=bool)   # row i sees columns <= start + i
    out = model.forward(prompts, np.arange(start, start + n), mask, cache)
    cache.length += n
    return out


def decode_step(model: Transformer, tokens: np.ndarray, cache: KVCache) -> ForwardOut:
    """Run one token per sequence (tokens [B]) at the next position and commit it."""
    start = cache.length
    mask = np.ones((1, start + 1), dtype=bool)
    out = model.forward(np.asarray(tokens)[:, None], np.array([start]), mask, cache)
    cache.length += 1
    return out


@dataclass
class Trajectory:
    """Greedy tokens of a batch and what was seen producing them; step i produced tokens[:, i]."""

    tokens: np.ndarray        # [B][n]
    logit_margin: np.ndarray  # [B][n] top-1 minus top-2 logit at each step
    route_margin: np.ndarray  # [B][n] min routing margin over the step's forward (all its tokens)
    group_margin: np.ndarray  # [B][n]
    hidden: np.ndarray        # [B][n][h] final hidden state that produced tokens[:, i]

    def row(self, i: int) -> "Trajectory":
        """Sequence i alone (as a batch of one)."""
        return Trajectory(*(getattr(self, f.name)[i:i + 1] for f in fields(self)))

    def steps_after_prompt(self) -> "Trajectory":
        """Steps 1.. alone (step 0's routing margins are those of the whole prompt)."""
        return Trajectory(*(getattr(self, f.name)[:, 1:] for f in fields(self)))


def generate(model: Transformer, prompts, n: int) -> Trajectory:
    """Greedy autoregressive decode of n tokens after each prompt (prompts [B][P], equal lengths)."""
    prompts = np.atleast_2d(np.asarray(prompts))
    batch = prompts.shape[0]
    cache = KVCache(model.args, batch, capacity=prompts.shape[1] + n, dtype=model.dtype)
    out = prefill(model, prompts, cache)
    # the first step's routing margins cover the whole prompt
    rm, gm = out.route_margin.min(axis=1), out.group_margin.min(axis=1)
    logits, hidden = out.logits[:, -1], out.hidden[:, -1]
    steps = []
    for i in range(n):
        token = np.argmax(logits, axis=-1)
        steps.append((token, top_margin(logits), rm, gm, hidden))
        if i + 1 < n:
            out = decode_step(model, token, cache)
            logits, hidden = out.logits[:, 0], out.hidden[:, 0]
            rm, gm = out.route_margin[:, 0], out.group_margin[:, 0]
    tokens, lm, rms, gms, hs = (np.stack(v, axis=1) for v in zip(*steps))
    return Trajectory(tokens, lm, rms, gms, hs)
