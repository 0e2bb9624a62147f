"""Every weight of a config, each made on its own from (seed, config name, tensor name).

A tensor's values are its own PRNG stream (kdtree_ref/prng.py, key `stream_key(seed, config,
name)`), so any tensor, any range of its rows, or one routed expert is made without the others,
and the same bytes come out whether a whole model is built (gen_model.py) or streamed
(kdtree_ref/streaming.py). The float32 weights, in row-major order of their shape:

- norms (attn_norm, ffn_norm, q_norm, kv_norm, norm): 1 + 0.1 u;
- every other matrix: u std sqrt(3), u = prng.uniform (on [-1, 1), grid 2^-23), with std
  fan_in^-1/2, GAIN_OUT fan_in^-1/2 for wo and every w2, GAIN_GATE dim^-1/2 for the router,
  GAIN_HEAD dim^-1/2 for the head, 1 for the embedding and 0.1 for the router's bias.

With `direct_int4` (the big configs, whose routed experts would not fit in memory as float32
masters), the routed experts are made directly as INT4 (`Weights.expert_int4`): the code of
element (o, i) of an expert's w1/w2/w3 [out][in] is code o*in + i of the stream
(seed, config, name, "codes") (prng.int4_codes: -7..7; the stored nibble is code + 8), and the
scale of its group g (inputs 32g..32g+31) is value o*(in/32) + g of the stream
(seed, config, name, "scales") as float32(s0 (1 + u/2)), u = prng.uniform, where
s0 = std / sqrt(56/3 x 13/12) makes the expert's weights have the float32 expert's std (56/3 is
the variance of a code uniform on -7..7, 13/12 the mean square of 1 + u/2). The weight is
code x scale in float32, as quant.dequantize computes it.
"""

import math
from dataclasses import dataclass

import numpy as np

from . import prng
from .model import ModelArgs
from .quant import GROUP_SIZE, dequantize, is_quantized, pack_nibbles, quantize

SEED = "kdtree-ref-v1"
# Weight scales (uniform weights with std gain / sqrt(fan_in)). Small attention and FFN outputs
# keep the residual stream close to the token embedding, so the next token is predictable
# enough for a linear drafter; a head gain of 4 makes the logits peaked (std about 4).
GAIN_OUT = 0.2      # wo and every w2
GAIN_GATE = 3.0     # router logits u . x with std about 3: sigmoid scores spread over (0, 1)
GAIN_HEAD = 4.0
SCALE_SPREAD = 0.5  # direct INT4 scales are s0 (1 + SCALE_SPREAD u)
CODE_VARIANCE = 56 / 3


@dataclass(frozen=True)
class TensorSpec:
    """One float32 master tensor: its shape and its std (None: a norm, 1 + 0.1 u)."""

    name: str
    shape: tuple[int, ...]
    std: float | None


def specs(args: ModelArgs) -> list[TensorSpec]:
    """The model's tensors under the README's names, in bundle order."""
    out = []

    def mat(name, shape, std):
        out.append(TensorSpec(name, tuple(shape), std))

    def norm(name, n):
        out.append(TensorSpec(name, (n,), None))

    def mlp(prefix, inter):
        mat(prefix + "w1", (inter, args.dim), args.dim**-0.5)
        mat(prefix + "w2", (args.dim, inter), GAIN_OUT * inter**-0.5)
        mat(prefix + "w3", (inter, args.dim), args.dim**-0.5)

    h, heads = args.dim, args.n_heads
    qk = args.qk_nope_head_dim + args.qk_rope_head_dim
    mat("embed", (args.vocab_size, h), 1.0)
    for layer in range(args.n_layers):
        p = f"layers.{layer}."
        norm(p + "attn_norm", h)
        norm(p + "ffn_norm", h)
        if args.q_lora_rank:
            mat(p + "attn.wq_a", (args.q_lora_rank, h), h**-0.5)
            norm(p + "attn.q_norm", args.q_lora_rank)
            mat(p + "attn.wq_b", (heads * qk, args.q_lora_rank), args.q_lora_rank**-0.5)
        else:
            mat(p + "attn.wq", (heads * qk, h), h**-0.5)
        mat(p + "attn.wkv_a", (args.kv_lora_rank + args.qk_rope_head_dim, h), h**-0.5)
        norm(p + "attn.kv_norm", args.kv_lora_rank)
        mat(p + "attn.wkv_b", (heads * (args.qk_nope_head_dim + args.v_head_dim), args.kv_lora_rank),
            args.kv_lora_rank**-0.5)
        mat(p + "attn.wo", (h, heads * args.v_head_dim), GAIN_OUT * (heads * args.v_head_dim)**-0.5)
        if layer < args.n_dense_layers:
            mlp(p + "ffn.", args.inter_dim)
        else:
            mat(p + "ffn.gate.weight", (args.n_routed_experts, h), GAIN_GATE * h**-0.5)
            mat(p + "ffn.gate.bias", (args.n_routed_experts,), 0.1)
            for e in range(args.n_routed_experts):
                mlp(p + f"ffn.experts.{e}.", args.moe_inter_dim)
            mlp(p + "ffn.shared.", args.n_shared_experts * args.moe_inter_dim)
    norm("norm", h)
    mat("head", (args.vocab_size, h), GAIN_HEAD * h**-0.5)
    return out


class Weights:
    """The weights of one config, made on demand (module docstring: the exact rule)."""

    def __init__(self, args: ModelArgs, direct_int4: bool = False, seed: str = SEED):
        self.args, self.direct_int4, self.seed = args, direct_int4, seed
        self.specs = {s.name: s for s in specs(args)}

    def is_direct(self, name: str) -> bool:
        """Whether `name` is a routed expert's matrix made directly as INT4 (no float32 master)."""
        return self.direct_int4 and ".ffn.experts." in name

    def _key(self, name: str, *part) -> int:
        return prng.stream_key(self.seed, self.args.name, name, *part)

    def fp32(self, name: str, rows: tuple[int, int] | None = None) -> np.ndarray:
        """The float32 tensor `name`, or its rows [r0, r1) (a 1-D tensor: elements)."""
        spec = self.specs[name]
        if self.is_direct(name):
            raise ValueError(f"{name} is made directly as INT4 (Weights.expert_int4); it has no float32 master")
        r0, r1 = rows or (0, spec.shape[0])
        shape = (r1 - r0, *spec.shape[1:])
        u = prng.uniform(self._key(name), shape, r0 * int(np.prod(spec.shape[1:], dtype=np.int64)))
        if spec.std is None:
            return (1.0 + 0.1 * u).astype(np.float32)
        return (u * (spec.std * 3**0.5)).astype(np.float32)

    def expert_codes(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(codes int8 [out][in] in -7..7, scales float32 [out][in/32]) of a direct routed expert matrix."""
        if not self.is_direct(name):
            raise ValueError(f"{name} is not a routed expert made directly as INT4")
        out_dim, in_dim = self.specs[name].shape
        codes = prng.int4_codes(self._key(name, "codes"), out_dim * in_dim).reshape(out_dim, in_dim)
        s0 = self.specs[name].std / math.sqrt(CODE_VARIANCE * (1 + SCALE_SPREAD**2 / 3))
        u = prng.uniform(self._key(name, "scales"), (out_dim, in_dim // GROUP_SIZE))
        return codes, (s0 * (1.0 + SCALE_SPREAD * u)).astype(np.float32)

    def expert_int4(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(qw int32 [out][in/8], sc float32 [out][in/32]) of a direct routed expert matrix, as stored."""
        codes, scales = self.expert_codes(name)
        return pack_nibbles(codes + 8), scales

    def expert_fp32(self, name: str) -> np.ndarray:
        """The float32 weight a direct routed expert matrix stands for: code x scale in float32
        (equal to quant.dequantize of expert_int4, without packing)."""
        codes, scales = self.expert_codes(name)
        out_dim, in_dim = codes.shape
        grouped = codes.reshape(out_dim, in_dim // GROUP_SIZE, GROUP_SIZE).astype(np.float32)
        grouped *= scales[..., None]
        return grouped.reshape(out_dim, in_dim)

    def lowrank_drafter(self, rank: int, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(v [r][2h], u [L][h][r], b [L][V]) float32 of a lowrank_head drafter made from the PRNG
        (streams drafter.v, drafter.u, drafter.b): u std r^-1/2 and v std (2h)^-1/2 give u (v f)
        about unit entries, so the head makes logits like the model's (std about GAIN_HEAD);
        b has std 1. Not fitted: its acceptance is low, which DDTree == AR checks do not mind."""
        h, vocab = self.args.dim, self.args.vocab_size
        made = []
        for name, shape, std in (("drafter.v", (rank, 2 * h), (2 * h)**-0.5), ("drafter.u", (block, h, rank), rank**-0.5),
                                 ("drafter.b", (block, vocab), 1.0)):
            made.append((prng.uniform(self._key(name), shape) * (std * 3**0.5)).astype(np.float32))
        return made[0], made[1], made[2]

    def stored(self, name: str, quant: dict) -> dict[str, np.ndarray]:
        """The tensors a bundle whose header `quant` is `quant` stores for the weight `name`:
        {name: float32}, or {name.qw, name.sc} for an INT4 one (a direct routed expert, or a
        quantized class: quant.py) made as quant.quantize of the float32 master."""
        if self.is_direct(name):
            qw, sc = self.expert_int4(name)
        elif quant["type"] == "int4" and is_quantized(name, tuple(quant.get("keep_fp32", ()))):
            qw, sc = quantize(self.fp32(name), GROUP_SIZE)
        else:
            return {name: self.fp32(name)}
        return {name + ".qw": qw, name + ".sc": sc}

    def model_weight(self, name: str, quant: dict, rows: tuple[int, int] | None = None) -> np.ndarray:
        """The float32 weight `name` (or its rows [r0, r1)) that a bundle with header `quant` stands for:
        the master, its dequantized INT4 form, or a direct expert's code x scale."""
        if self.is_direct(name):
            weight = self.expert_fp32(name)
            return weight if rows is None else weight[rows[0]:rows[1]]
        master = self.fp32(name, rows)
        if quant["type"] == "int4" and is_quantized(name, tuple(quant.get("keep_fp32", ()))):
            return dequantize(*quantize(master, GROUP_SIZE), GROUP_SIZE)
        return master

    def all_fp32(self) -> dict[str, np.ndarray]:
        """Every float32 master tensor, in bundle order (not for configs with direct experts)."""
        return {name: self.fp32(name) for name in self.specs}
