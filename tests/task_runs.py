"""Tasks as the tests run them: through the functions the tasks call (cli.deploy: the pipeline's
sync step under the run's lock; cli.doctor: its preflight step), and what the run said and
recorded of one host."""
from __future__ import annotations

import dataclasses
import io
import json
import re

from orchestrator import cli, doctor
from orchestrator.runner.console import Console
from orchestrator.inventory import Host, Inventory

# the sync step's message when it passed (steps/sync.py)
_PASSED = re.compile(r"(rsync|tar): (\d+) files, (\d+) bytes sent, (\d+) deleted(?:; repaired a broken sync \((.*)\))?")
_RECOVERED = re.compile(r"recovered the lock left by a run that died: (.*)$", re.M)
_FINDING = re.compile(r"(ok|warn|fail) +(\w+) +(.*)")     # a line of the preflight step's log (steps/preflight.py)


@dataclasses.dataclass(frozen=True)
class Deployed:
    """One host's deploy: the exit code, the sync step's status and message, what its message says
    was sent (None when it failed), the tree hash the run recorded, the owner of a dead run's lock
    it recovered, the console's output and the step's log lines."""

    code: int
    status: str
    message: str
    method: str | None
    files: int | None
    bytes: int | None
    deleted: int | None
    repaired: str | None
    tree_hash: str | None
    stale_lock: str | None
    seconds: float
    output: str
    log: list[str]


def deploy_task(inv: Inventory, name: str) -> Deployed:
    """Deploy the inventory's project to host `name` as `invoke deploy --host NAME` does."""
    out = io.StringIO()
    code = cli.deploy(inv, [inv.hosts[name]], Console(out))
    run_dir = inv.project.root / "runs" / "latest"
    host = json.loads((run_dir / "run.json").read_text())["hosts"][name]
    step = host["steps"]["sync"]
    log = run_dir / name / "sync.log"
    sent = _PASSED.fullmatch(step["message"]) if step["status"] == "passed" else None
    stale = _RECOVERED.search(out.getvalue())
    return Deployed(code, step["status"], step["message"], sent and sent[1], sent and int(sent[2]),
                    sent and int(sent[3]), sent and int(sent[4]), sent and sent[5], host["deployed_tree_hash"],
                    stale and stale[1], step["seconds"], out.getvalue(),
                    log.read_text().splitlines() if log.exists() else [])


@dataclasses.dataclass(frozen=True)
class Doctored:
    """One host's doctor run: the exit code, each check's finding as the preflight step logged
    it, the console's output."""

    code: int
    findings: dict[str, doctor.Finding]
    output: str


def doctor_task(inv: Inventory, host: Host) -> Doctored:
    """Check `host` (an entry of `inv`) as `invoke doctor --host NAME` does."""
    out = io.StringIO()
    code = cli.doctor(inv, [host], Console(out))
    lines = (inv.project.root / "runs" / "latest" / host.name / "preflight.log").read_text().splitlines()
    found = {m[2]: doctor.Finding(m[2], m[1], m[3]) for m in map(_FINDING.fullmatch, lines) if m}
    return Doctored(code, found, out.getvalue())
