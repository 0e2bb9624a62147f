""".github/workflows/nightly.yml as a runner executes it: its own `run:` scripts, as written, with
bash, in a checkout of this repository whose hosts.yaml names a loopback sshd host, with the
workflow's env, two nights in a row. The first night passes (exit 0); the second, whose bench
result is cut a thousandfold through the inventory's bench command, exits 3 against the first night,
found as the last good nightly in the history outside the checkout.

(Run after test_validate.py, by tests/early_builds.py's PIPELINE_ORDER: a copy of that module's
deployment on h1, when the session has one, saves a night its engine build.)
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
WORKFLOW = REPO / ".github" / "workflows" / "nightly.yml"
EXPRESSION = re.compile(r"\$\{\{\s*(\w+)\.(\w+)\s*\}\}")
# A light bench (one budget, one repeat, the fewest MoE experts, one token count): the figures only need to exist.
LIGHT_BENCH = 'KD_BENCH_ARGS="--budgets 4 --repeats 1 --moe-experts 8 --moe-tokens 1" bash scripts/bench.sh'
# Likewise the engine's tests: the model tests on the tiny bundles (the whole suite runs in test_engine_native.py).
LIGHT_TEST = "KD_TEST_BUNDLES=tiny_fp32,tiny_int4 bash scripts/run_tests.sh"
# The injected regression: every higher-is-better figure of the bench result (value, samples and
# figures per CPU second) cut a thousandfold: code that much slower, not a run starved of CPU. (A
# tenth was too little: with one repeat on a 2-core machine at a load of 9, k2mini_int4's DDTree
# speed-up, a ratio of two timings, moved more than tenfold from one night to the next.)
CUT = ("python3 -c 'import json; p = \"build/bench.json\"; d = json.load(open(p)); "
       "[m.update(value=m[\"value\"] / 1000, **{k: [v / 1000 for v in m[k]] for k in (\"samples\", \"cpu_samples\") if k in m}) "
       "for m in d[\"metrics\"].values() if m.get(\"better\") == \"higher\"]; "
       "json.dump(d, open(p, \"w\"))'")


def evaluate(text: str, contexts: dict[str, dict[str, str]]) -> str:
    """A workflow value with its `${{ context.name }}` expressions filled in (an unknown one fails)."""
    def one(match: re.Match) -> str:
        context, name = match.groups()
        assert context in contexts, f"the test does not know the workflow's context {context!r}"
        return contexts[context].get(name, "")
    return EXPRESSION.sub(one, text)


def github_env(path: Path) -> dict[str, str]:
    """The variables a step wrote to $GITHUB_ENV (NAME=value lines and NAME<<DELIMITER blocks)."""
    found, lines = {}, path.read_text().splitlines()
    while lines:
        line = lines.pop(0)
        if "<<" in line and ("=" not in line or line.index("<<") < line.index("=")):
            name, delimiter = line.split("<<", 1)
            value = []
            while (item := lines.pop(0)) != delimiter:
                value.append(item)
            found[name] = "\n".join(value)
        elif line:
            name, value = line.split("=", 1)
            found[name] = value
    return found


def night(checkout: Path, run_id: int, inputs: dict, variables: dict, base_env: dict) -> dict:
    """One night of the workflow's job: each `run:` step's script with `bash -e` (a runner's
    default shell) in `checkout`, the job's env and what earlier steps put into $GITHUB_ENV; a step
    without `if: always()` runs only while every step before it passed; `uses:` steps are not run,
    but an upload's `path` must exist. Returns the exit codes by step name and the job's env."""
    job = yaml.safe_load(WORKFLOW.read_text())["jobs"]["nightly"]
    env_file = checkout.parent / f"github-env-{run_id}"
    env_file.write_text("")
    contexts = {"inputs": inputs, "vars": variables, "github": {"run_id": str(run_id)}}
    env = {**base_env, "GITHUB_ENV": str(env_file), "GITHUB_RUN_ID": str(run_id), "GITHUB_WORKSPACE": str(checkout),
           "CI": "true", **{k: evaluate(str(v), contexts) for k, v in job.get("env", {}).items()}}
    codes, failed = {}, False
    for i, step in enumerate(job["steps"]):
        name = step.get("name") or step.get("uses") or f"step {i}"
        condition = step.get("if")
        assert condition in (None, "always()"), f"{name}: the test does not know the condition {condition!r}"
        if failed and condition != "always()":
            codes[name] = None
            continue
        env.update(github_env(env_file))
        if "run" in step:
            assert "${{" not in step["run"], f"{name}: an expression in a script (template injection)"
            script = checkout.parent / f"step-{run_id}-{i}.sh"
            script.write_text(step["run"])
            proc = subprocess.run(["bash", "-e", str(script)], cwd=checkout, env=env, capture_output=True,
                                  text=True, timeout=1500)
            codes[name] = proc.returncode
            (checkout.parent / f"step-{run_id}-{i}.log").write_text(proc.stdout + proc.stderr)
            failed = failed or proc.returncode != 0
        elif step["uses"].startswith("actions/upload-artifact@"):
            path = evaluate(step["with"]["path"], {**contexts, "env": env})
            codes[name] = 0 if Path(path).exists() else f"no {path}"
    env.update(github_env(env_file))
    return {"codes": codes, "env": env}


def check_out(checkout: Path, reference_bundles, keep: str | None = None) -> None:
    """A fresh checkout of the working tree (actions/checkout cleans the previous night's files)
    but for the folder `keep`, as a runner's cache would keep it, with the session's reference
    bundles in its local bundle cache: the nights skip this machine's regeneration (half a minute
    on 2 cores), which the nightly makes as validate does and test_validate.py tests."""
    kept = checkout.parent / "kept"
    if keep:
        (checkout / keep).rename(kept)
    shutil.rmtree(checkout, ignore_errors=True)
    checkout.mkdir(parents=True)
    if keep:
        kept.rename(checkout / keep)
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for rel in filter(None, files):
        if (REPO / rel).is_file():
            (checkout / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, checkout / rel)
    reference_bundles.seed_local_cache(checkout, checkout / "engine_src")


def write_hosts(checkout: Path, entry: dict, bench: str) -> None:
    """The checkout's hosts.yaml: the shipped project section with `bench` as its bench commands
    (validate's and the nightly's) and LIGHT_TEST as its test command, and one host, h1 (the nightly validates every host but `local`)."""
    data = yaml.safe_load((REPO / "hosts.yaml").read_text())
    assert "bench_nightly" in data["project"]["commands"]         # the shipped nightly measures with its own
    data["project"]["commands"]["bench"] = data["project"]["commands"]["bench_nightly"] = bench
    data["project"]["commands"]["test"] = LIGHT_TEST
    data["hosts"] = {"h1": entry}
    data.pop("groups", None)
    (checkout / "hosts.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


def nightly_code(result: dict) -> int:
    return next(code for name, code in result["codes"].items() if name.startswith("Nightly validate"))


@pytest.mark.timeout(2400)      # two nights of seven steps with the real engine (15 min at load 30 on 2 cores)
@pytest.mark.skipif(shutil.which("git") is None, reason="the checkout is made from git's list of files")
def test_the_nightly_workflow_passes_then_flags_a_regression(lab, reference_bundles, tmp_path):
    h1 = lab.hosts["h1"]
    remote_dir = h1.root / "workflow-nightly"
    shutil.rmtree(remote_dir, ignore_errors=True)
    if (h1.root / "engine" / "build" / "kdtree").is_file():       # test_validate's deployment: its build
        shutil.copytree(h1.root / "engine", remote_dir, symlinks=True)
    entry = lab.inventory_entry(h1, remote_dir=str(remote_dir))
    state = tmp_path / "state"
    checkout = tmp_path / "work" / "kdtree"
    base_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    base_env.update(lab.env())
    variables = {"KDTREE_NIGHTLY_STATE": str(state)}

    check_out(checkout, reference_bundles)
    write_hosts(checkout, entry, LIGHT_BENCH)
    first = night(checkout, 1001, {}, variables, base_env)
    logs = "\n".join(p.read_text()[-3000:] for p in sorted(tmp_path.glob("work/step-1001-*.log")))
    assert set(first["codes"].values()) == {0}, (first["codes"], logs)
    first_dir = Path(first["env"]["RUN_DIR"])
    assert first_dir.parent.resolve() == (state / "runs").resolve() and (first_dir / "junit.xml").is_file()
    first_run = json.loads((first_dir / "run.json").read_text())
    assert first_run["command"] == "nightly" and first_run["status"] == "passed" and not first_run["regressions"]
    assert first_run["run_id"] == first_dir.name
    metrics = first_run["hosts"]["h1"]["bench"]["metrics"]
    higher = {name: m["value"] for name, m in metrics.items() if m["better"] == "higher" and m["value"] > 0}
    assert higher

    # The second night keeps the first one's virtual environment, as a runner's cache would: its install
    # step finds the dependencies there (the first night tested a fresh install; a second one costs CI
    # half a minute of unpacking wheels on 2 cores).
    check_out(checkout, reference_bundles, keep=".venv")
    write_hosts(checkout, entry, f"{LIGHT_BENCH} && {CUT}")
    second = night(checkout, 1002, {}, variables, base_env)
    logs = "\n".join(p.read_text()[-3000:] for p in sorted(tmp_path.glob("work/step-1002-*.log")))
    assert nightly_code(second) == 3, (second["codes"], logs)
    assert [code for name, code in second["codes"].items() if not name.startswith("Nightly validate")] == \
        [0] * (len(second["codes"]) - 1), second["codes"]           # uploads and the clean step still ran
    second_dir = Path(second["env"]["RUN_DIR"])
    second_run = json.loads((second_dir / "run.json").read_text())
    assert second_run["status"] == "passed"
    regressions = {r["metric"]: r for r in second_run["regressions"] if r["host"] == "h1"}
    assert set(higher) <= set(regressions), (higher, regressions)
    for name, value in higher.items():       # against the first night: the last good nightly
        assert regressions[name]["baseline"] == value and regressions[name]["ratio"] < 0.5
    assert sorted(p.name for p in (state / "runs").iterdir() if p.is_dir() and p.name != "latest") == \
        sorted([first_dir.name, second_dir.name])
