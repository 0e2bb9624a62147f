"""The file `invoke` finds in the checkout: the orchestrator's tasks live in the package
(orchestrator/tasks.py, which `kdtree-orch` runs too). `invoke --list`, `invoke deploy -h`."""
import sys

# Invoke turns bytecode writing off before it loads this file (its --write-pyc, default off), so
# every module of the package was compiled from source on every run from a checkout (0.2-0.4 s
# a run here). The interpreter's own setting (-B, PYTHONDONTWRITEBYTECODE) still decides.
sys.dont_write_bytecode = bool(sys.flags.dont_write_bytecode)

from orchestrator.tasks import namespace  # noqa: E402,F401  (Invoke loads a tasks module's `namespace`)
