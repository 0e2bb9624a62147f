"""What a bundle needs of the host that runs it: the manifest entry's `needs`, read by the
orchestrator's preflight before anything is written (disk, RAM of one engine process, GPU memory)."""

from .model import ModelArgs

# Rows per forward the scripts' runs ask for at most: DDTree budgets up to 64 (bench's default
# list) plus the root, or the whole prompt.
NEEDS_MAX_BUDGET = 64
NEEDS_PROCESS_BYTES = 64 << 20    # the engine process itself (code, stacks, allocator slack)
NEEDS_GPU_WORKSPACE = 512 << 20   # the CUDA context and the backend's scratch on the GPU


def bundle_needs(args: ModelArgs, file_bytes: int, weight_bytes: int, block_size: int, prompt_len: int) -> dict:
    """The bundle's needs in bytes: disk (the file), RAM of one engine process running it (the
    engine's own estimate, Bundle::check_memory: the file read whole, the weights as the backend
    holds them, KV caches for max_seq_len and the forward's buffers for the largest run; plus
    NEEDS_PROCESS_BYTES) and GPU memory (weights, the same KV caches and buffers, and
    NEEDS_GPU_WORKSPACE)."""
    a = args
    rows = max(prompt_len, 1 + NEEDS_MAX_BUDGET)
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    row_width = a.kv_lora_rank + a.qk_rope_head_dim
    ffn_width = max(a.inter_dim, a.n_shared_experts * a.moe_inter_dim)
    experts, top_k = max(a.n_routed_experts, 1), max(a.n_activated_experts, 1)
    # model_buffer_bytes (engine_src/src/config.cpp), term for term
    floats = a.n_layers * (a.max_seq_len + rows) * row_width
    per_row = (6 * a.dim + max(a.q_lora_rank, 1) + a.n_heads * qk + a.n_heads * a.v_head_dim + 2 * ffn_width
               + experts + 2 * top_k + a.vocab_size + (top_k + 2) * a.dim + 2 * max(a.moe_inter_dim, a.inter_dim)
               + max(a.dim, ffn_width, a.n_heads * a.v_head_dim) + row_width)
    floats += rows * per_row + 2 * a.dim + 3 * block_size * a.vocab_size
    floats += 2 * a.dim + block_size * a.dim      # a lowrank_head drafter's buffers (counted for every drafter)
    buffers = 4 * floats + 256 * (4 * a.n_layers + 64)
    return {"disk_bytes": file_bytes, "ram_bytes": file_bytes + weight_bytes + buffers + NEEDS_PROCESS_BYTES,
            "gpu_bytes": weight_bytes + buffers + NEEDS_GPU_WORKSPACE}
