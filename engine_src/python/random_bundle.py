#!/usr/bin/env python3
"""Write a version 2 KDTR bundle of random weights with the streaming writer, in parallel: a
stand-in for a big bundle when timing how fast readers check one (nothing decodes it usefully).

    python/random_bundle.py OUT [--config JSON] [--quant JSON] [--drafter JSON] [--workers N] [--size BYTES]

Defaults: a two-layer model of about 2.0 GB (hidden 2048, vocab 32768, 48 routed experts of width
1024, a low-rank drafter), fp32, 2 workers. --size: the routed experts (count and width) set so
that the file is about that size (sized_config). Weights are uniform in [-1, 1) (int4 codes: any word),
each tensor from its own seed, so the bytes do not depend on the worker count. Prints the
bundle's size, identity and the seconds it took.
"""

import argparse
import json
import multiprocessing
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kdtree_ref import kdtr, stream  # noqa: E402
from kdtree_ref.schema import tensor_specs  # noqa: E402

CONFIG = {"name": "random2g", "vocab_size": 32768, "dim": 2048, "n_layers": 2, "n_dense_layers": 1, "n_heads": 16,
          "q_lora_rank": 512, "kv_lora_rank": 256, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64,
          "inter_dim": 8192, "moe_inter_dim": 1024, "n_routed_experts": 48, "n_shared_experts": 1,
          "n_activated_experts": 8, "n_expert_groups": 1, "n_limited_groups": 1, "route_scale": 2.5,
          "rope_theta": 10000.0, "norm_eps": 1e-6, "max_seq_len": 256}
ROWS_PER_BLOCK = 1 << 20  # elements per block a worker makes and writes at a time
EXPERT_COUNTS = (384, 256, 128, 64, 32, 16, 8)  # K2's count first; top-8 routing needs 8


def _meta(config: dict, quant: dict, drafter: dict) -> dict:
    return {"config": config, "quant": quant, "drafter": drafter, "prompt": [1, 2, 3], "golden": [4, 5]}


def sized_config(config: dict, quant: dict, drafter: dict, size: int) -> dict:
    """The config with n_routed_experts and moe_inter_dim (a multiple of 32) chosen so its bundle is
    about `size` bytes: the most experts of EXPERT_COUNTS that fit at width 32, then the width that
    comes closest. Raises ValueError when even 8 experts of width 32 are over the size."""
    def size_at(experts: int, width: int) -> int:
        c = dict(config, n_routed_experts=experts, moe_inter_dim=width, n_activated_experts=min(8, experts))
        meta = _meta(c, quant, drafter)
        return kdtr.plan(meta, tensor_specs(meta)).size

    for experts in EXPERT_COUNTS:
        narrow = size_at(experts, 32)
        if narrow <= size:
            per_32 = size_at(experts, 64) - narrow
            width = 32 * (1 + round((size - narrow) / per_32))
            return dict(config, n_routed_experts=experts, moe_inter_dim=width, n_activated_experts=min(8, experts))
    raise ValueError(f"--size {size}: the smallest bundle of this config is {size_at(EXPERT_COUNTS[-1], 32)} bytes")


def _write(path, plan, indices) -> dict[str, bytes]:
    """Write the tensors at these table positions, block by block; their sha256 by name."""
    digests = {}
    with stream.Part(path, plan) as part:
        for i in indices:
            spec = plan.specs[i]
            rng = np.random.default_rng(i)
            sink = part.rows(spec.name)
            row = int(np.prod(spec.shape[1:], dtype=np.int64)) if spec.shape else 1
            rows = spec.shape[0] if spec.shape else 1
            step = max(1, ROWS_PER_BLOCK // max(row, 1))
            for first in range(0, rows, step):
                shape = (min(step, rows - first),) + tuple(spec.shape[1:])
                if spec.dtype == "f32":
                    block = (rng.random(shape, dtype=np.float32) * 2 - 1).astype(np.float32)
                else:
                    block = rng.integers(-2**31, 2**31, shape, dtype=np.int64).astype(np.int32)
                sink.write(block if spec.shape else block.reshape(()))
            digests[spec.name] = sink.close()
    return digests


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--config", type=json.loads, default=CONFIG)
    parser.add_argument("--quant", type=json.loads, default={"type": "fp32"})
    parser.add_argument("--drafter", type=json.loads,
                        default={"block_size": 8, "mask_token": CONFIG["vocab_size"] - 1, "kind": "lowrank_head", "rank": 64})
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--size", type=int, help="bytes the bundle should have, about (sets the routed experts)")
    args = parser.parse_args(argv)
    config = args.config
    if args.size is not None:
        try:
            config = sized_config(config, args.quant, args.drafter, args.size)
        except ValueError as e:
            parser.error(str(e))
    meta = _meta(config, args.quant, args.drafter)
    t0 = time.monotonic()
    plan = kdtr.plan(meta, tensor_specs(meta))
    stream.create(args.out, plan)
    # Tensors dealt largest first, round robin, so the workers' shares are close in bytes.
    order = sorted(range(len(plan.specs)), key=lambda i: -plan.specs[i].nbytes)
    shares = [order[w::args.workers] for w in range(args.workers)]
    with multiprocessing.get_context("fork").Pool(args.workers) as pool:
        parts = pool.starmap(_write, [(args.out, plan, share) for share in shares])
    identity = stream.finish(args.out, plan, {k: v for part in parts for k, v in part.items()})
    print(f"wrote {args.out}: {plan.size} bytes, {len(plan.specs)} tensors, identity {identity}, "
          f"{time.monotonic() - t0:.1f} s with {args.workers} workers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
