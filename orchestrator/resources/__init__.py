"""What a host has and what a run needs of it: its GPUs as nvidia-smi reports them and the
selection policy (gpus.py), the per-GPU claims a run holds beside the tree lock (gpu_claims.py),
the bundles a host runs and their declared needs (bundle_plan.py), and whether its disk and RAM
hold them (capacity.py).

bundle_plan.py <- capacity.py -> gpus.py <- gpu_claims.py
"""
