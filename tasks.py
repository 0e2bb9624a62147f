"""The file `invoke` finds in the checkout: the orchestrator's tasks live in the package
(orchestrator/tasks.py, which `kdtree-orch` runs too). `invoke --list`, `invoke deploy -h`."""
from orchestrator.tasks import namespace  # noqa: F401  (Invoke loads a tasks module's `namespace`)
