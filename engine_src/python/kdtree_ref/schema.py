"""The tensors a KDTR bundle holds, from its header alone: names, dtypes and shapes.

A bundle holds exactly these tensors (the readers refuse a missing or an extra one, extra layer
tensors included), in this order as the writers lay them out: embed; per layer attn_norm,
ffn_norm, attention (wq_a, q_norm, wq_b or wq; wkv_a, kv_norm, wkv_b, wo), FFN (w1, w2, w3, or
gate.weight, gate.bias, experts 0.. w1 w2 w3, shared w1 w2 w3 when n_shared_experts > 0); norm,
head, then the drafter's tensors.

Header extensions (fixed by the format's specification):
- `quant`: `{"type": "fp32"}` or `{"type": "int4", "group_size": 32, "keep_fp32": [...]}`. In an
  int4 bundle every ffn.w1/w2/w3 is stored as `<name>.qw` (int32 [out][in/8]) and `<name>.sc`
  (float32 [out][in/32]), except the classes named in the optional `keep_fp32` list (default
  empty, no repeats): "dense" = the dense layers' ffn.w1/w2/w3, "shared" = the shared expert's.
  The routed experts are int4 whenever type is int4. Any other key or class is refused.
- `drafter`: `{"block_size": L, "mask_token": m}` plus an optional `kind`: absent or "linear" =
  `drafter.w` [L][V][2h] and `drafter.b` [L][V]; "lowrank_head" (with `"rank": r`, 1 <= r <= 2h)
  = `drafter.v` [r][2h], `drafter.u` [L][h][r], `drafter.b` [L][V] and no `drafter.w`. Any other
  key or kind is refused.
"""

from dataclasses import dataclass
from math import prod

from .model import ModelArgs

QUANT_TYPES = ("fp32", "int4")
KEEP_FP32_CLASSES = ("dense", "shared")
DRAFTER_KINDS = ("linear", "lowrank_head")
GROUP_SIZE = 32
_DTYPE_BYTES = {"f32": 4, "i32": 4}


class SchemaError(ValueError):
    """A header whose quant, drafter or config cannot define a tensor set; the message names the field."""


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a bundle as the header's table describes it (before any offset is known)."""

    name: str
    dtype: str          # "f32" or "i32"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return _DTYPE_BYTES[self.dtype] * prod(self.shape)


def _exact_keys(obj, where: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict:
    if not isinstance(obj, dict):
        raise SchemaError(f"{where}: expected an object, got {type(obj).__name__}")
    missing = [k for k in required if k not in obj]
    if missing:
        raise SchemaError(f"{where}.{missing[0]}: missing")
    unknown = sorted(set(obj) - set(required) - set(optional))
    if unknown:
        raise SchemaError(f"{where}: unknown key {unknown[0]!r}")
    return obj


def _int(obj: dict, key: str, where: str, lo: int, hi: int) -> int:
    if key not in obj:
        raise SchemaError(f"{where}.{key}: missing")
    value = obj[key]
    if type(value) is not int or not lo <= value <= hi:
        raise SchemaError(f"{where}.{key}: expected an integer in [{lo}, {hi}], got {value!r}")
    return value


def quant_classes(quant) -> tuple[str, frozenset[str]]:
    """(type, the keep_fp32 classes) of a header's `quant`; a SchemaError names what is wrong."""
    q = _exact_keys(quant, "quant", ("type",), ("group_size", "keep_fp32"))
    if q["type"] not in QUANT_TYPES:
        raise SchemaError(f"quant.type: unknown quant type {q['type']!r}")
    if q["type"] == "fp32" and len(q) > 1:
        raise SchemaError(f"quant: {sorted(set(q) - {'type'})[0]!r} is only for int4")
    if "group_size" in q:
        _int(q, "group_size", "quant", GROUP_SIZE, GROUP_SIZE)
    keep = q.get("keep_fp32", [])
    if not isinstance(keep, list) or len(set(map(str, keep))) != len(keep):
        raise SchemaError(f"quant.keep_fp32: expected a list of distinct weight classes, got {keep!r}")
    unknown = [k for k in keep if k not in KEEP_FP32_CLASSES]
    if unknown:
        raise SchemaError(f"quant.keep_fp32: unknown weight class {unknown[0]!r} (known: {', '.join(KEEP_FP32_CLASSES)})")
    return q["type"], frozenset(keep)


def drafter_kind(drafter, dim: int, vocab: int) -> tuple[str, int, int]:
    """(kind, block_size, rank; rank 0 for linear) of a header's `drafter`; a SchemaError names what is wrong."""
    kind = drafter.get("kind", "linear") if isinstance(drafter, dict) else None
    optional = ("kind", "rank") if kind == "lowrank_head" else ("kind",)
    d = _exact_keys(drafter, "drafter", ("block_size", "mask_token") + (("rank",) if kind == "lowrank_head" else ()), optional)
    if kind not in DRAFTER_KINDS:
        raise SchemaError(f"drafter.kind: unknown drafter kind {kind!r} (known: {', '.join(DRAFTER_KINDS)})")
    block = _int(d, "block_size", "drafter", 1, 256)
    _int(d, "mask_token", "drafter", 0, vocab - 1)
    rank = _int(d, "rank", "drafter", 1, 2 * dim) if kind == "lowrank_head" else 0
    return kind, block, rank


def model_args(config) -> ModelArgs:
    """The header's `config` as ModelArgs; a SchemaError names an unknown or bad field."""
    if not isinstance(config, dict):
        raise SchemaError(f"config: expected an object, got {type(config).__name__}")
    try:
        args = ModelArgs.from_json(config)
    except (TypeError, ValueError) as err:
        raise SchemaError(str(err)) from None
    for name in ("vocab_size", "dim", "n_layers", "n_dense_layers", "n_heads", "q_lora_rank", "kv_lora_rank",
                 "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "inter_dim", "moe_inter_dim",
                 "n_routed_experts", "n_shared_experts"):
        _int(config, name, "config", 0, 2**31 - 1)  # the ranges and relations are the engine's to check
    return args


def tensor_specs(header: dict) -> list[TensorSpec]:
    """Every tensor a bundle with this header holds, in the writers' order; a SchemaError names a bad field."""
    a = model_args(header.get("config"))
    quant, keep = quant_classes(header.get("quant"))
    kind, block, rank = drafter_kind(header.get("drafter"), a.dim, a.vocab_size)
    h, heads, qk = a.dim, a.n_heads, a.qk_nope_head_dim + a.qk_rope_head_dim
    specs: list[TensorSpec] = []

    def f32(name, *shape):
        specs.append(TensorSpec(name, "f32", shape))

    def linear(name, out, inp, int4):
        if int4:
            if inp % GROUP_SIZE:
                raise SchemaError(f"config: {name} has {inp} inputs, not a multiple of {GROUP_SIZE} as int4 needs")
            specs.append(TensorSpec(name + ".qw", "i32", (out, inp // 8)))
            f32(name + ".sc", out, inp // GROUP_SIZE)
        else:
            f32(name, out, inp)

    def mlp(prefix, inter, int4):
        linear(prefix + "w1", inter, h, int4)
        linear(prefix + "w2", h, inter, int4)
        linear(prefix + "w3", inter, h, int4)

    int4 = quant == "int4"
    f32("embed", a.vocab_size, h)
    for layer in range(a.n_layers):
        p = f"layers.{layer}."
        f32(p + "attn_norm", h)
        f32(p + "ffn_norm", h)
        if a.q_lora_rank:
            f32(p + "attn.wq_a", a.q_lora_rank, h)
            f32(p + "attn.q_norm", a.q_lora_rank)
            f32(p + "attn.wq_b", heads * qk, a.q_lora_rank)
        else:
            f32(p + "attn.wq", heads * qk, h)
        f32(p + "attn.wkv_a", a.kv_lora_rank + a.qk_rope_head_dim, h)
        f32(p + "attn.kv_norm", a.kv_lora_rank)
        f32(p + "attn.wkv_b", heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank)
        f32(p + "attn.wo", h, heads * a.v_head_dim)
        if layer < a.n_dense_layers:
            mlp(p + "ffn.", a.inter_dim, int4 and "dense" not in keep)
        else:
            f32(p + "ffn.gate.weight", a.n_routed_experts, h)
            f32(p + "ffn.gate.bias", a.n_routed_experts)
            for e in range(a.n_routed_experts):
                mlp(p + f"ffn.experts.{e}.", a.moe_inter_dim, int4)
            if a.n_shared_experts:
                mlp(p + "ffn.shared.", a.n_shared_experts * a.moe_inter_dim, int4 and "shared" not in keep)
    f32("norm", h)
    f32("head", a.vocab_size, h)
    if kind == "linear":
        f32("drafter.w", block, a.vocab_size, 2 * h)
    else:
        f32("drafter.v", rank, 2 * h)
        f32("drafter.u", block, h, rank)
    f32("drafter.b", block, a.vocab_size)
    return specs
