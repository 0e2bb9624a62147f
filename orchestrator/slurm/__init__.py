"""A partition of a Slurm cluster as a host kind (docs/slurm.md), one module per job:

    entry.py      the `scheduler: slurm` entry of hosts.yaml: its keys, SlurmRequest, their validation
    facts.py      what Slurm prints, read strictly: a job's facts, scontrol's words, GPU GRES, the errors
    commands.py   the Slurm commands through the login node: sbatch, the queue limit, scontrol, srun, scancel
    run.py        a Slurm entry in a run: its allocation around the steps on a compute node, their job steps
"""
from __future__ import annotations

# The keys of a `scheduler: slurm` host entry (entry.py reads them). Here, not in entry.py: the
# inventory checks every entry against them, and imports entry.py only for an entry that uses one.
SLURM_KEYS = ("scheduler", "partition", "account", "qos", "constraint", "cpus_per_task", "mem", "time_limit",
              "queue_limit", "slurm_conf")
