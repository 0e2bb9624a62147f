"""A small model shaped like k2wide, for the engine's tests (scripts/run_tests.sh) and the reference's.

    $PYTHON tests/small_k2.py OUT_DIR

Writes the two bundles of `k2small` (not committed: made in seconds) into OUT_DIR and prints one
line per bundle: name, file, golden tokens (comma-separated). k2small has what k2wide's bundles
have and the tiny configs' lack: routed experts made directly as INT4 codes, an int4 twin keeping
the dense FFN and the shared expert fp32 (quant.keep_fp32, labelled fp32), a lowrank_head drafter
(random, so its acceptance is low: the check is DDTree == AR), YaRN with beta_fast == beta_slow
(Kimi-K2's), sigmoid routing without groups, one dense and one MoE layer. Its golden tokens are
the float64 reference's.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))

import gen_model  # noqa: E402
from kdtree_ref.model import ModelArgs, RopeScaling  # noqa: E402

ARGS = ModelArgs(
    name="k2small", vocab_size=96, dim=64, n_layers=2, n_dense_layers=1, n_heads=2, q_lora_rank=32,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, inter_dim=96, moe_inter_dim=32,
    n_routed_experts=16, n_shared_experts=1, n_activated_experts=4, n_expert_groups=1, n_limited_groups=1,
    route_scale=2.827, rope_theta=50000.0,
    rope_scaling=RopeScaling(factor=32.0, original_max_position_embeddings=32, beta_fast=1.0, beta_slow=1.0,
                             mscale=1.0, mscale_all_dim=1.0),
    norm_eps=1e-6, max_seq_len=256)
RECIPE = gen_model.Recipe(direct_int4=True, twin_keep_fp32=("dense", "shared"), drafter_rank=8)
RULE = gen_model.GoldenRule()


def build() -> list:
    """k2small's two bundles (gen_model.Built), fp32 twin first."""
    return gen_model.build_config(ARGS, RECIPE, RULE)


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for b in build():
        (out / b.entry["file"]).write_bytes(b.blob)
        print(b.name, b.entry["file"], ",".join(map(str, b.entry["golden"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
