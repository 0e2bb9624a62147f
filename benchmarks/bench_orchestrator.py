#!/usr/bin/env python3
"""Orchestrator performance against the hand-written commands and Ansible, on loopback sshd hosts.

    python3 benchmarks/bench_orchestrator.py [--hosts 1,4,8,16] [--repeats 5] [--json out.json]
                                             [--sections deploy,validate,fanout,counts]
                                             [--work-dir DIR] [--files 3000] [--no-ansible]

A script, not a test (pytest never collects it). It starts max(--hosts) OpenSSH sshd processes on
127.0.0.1 (tests/sshd.py, imported by path: own port, host key and remote root each), copies
engine_src/ into the work dir and adds a synthetic tree of --files small files, then measures the
median of --repeats runs of:

  deploy     cold (empty host), warm with no change, warm with one changed file, on one host, for
             - invoke:  `python3 -m invoke deploy --inventory INV --host node1` (a subprocess, as a
                        user runs it: start-up, local tree hash, lock, rsync, remote hash, record);
             - bare:    `rsync -az --delete --exclude ... -e "ssh -F CFG ..." SRC/ node1:DIR/ &&
                         ssh -F CFG ... node1 'cd DIR && bash scripts/tree_hash.sh'`;
             - ansible: ansible-playbook (the `ansible` package from PyPI, in its own venv under the
                        work dir): ansible.posix.synchronize (delete, the same excludes) + a shell task
                        running the tree hash; gather_facts off; Ansible's default ssh settings.
  validate   a full `invoke validate` on an empty host (CPU backend) against a no-op one right after
             it (nothing changed: build and bundles cached).
  fanout     warm deploy, deploy with one changed file and `invoke doctor` on 1, 4, 8, 16 hosts at
             once (the bare commands too, one process per host in parallel): wall time / 1 host.
  counts     ssh connections and sessions (remote round trips) per host per run, from the hosts' sshd
             logs (LogLevel VERBOSE: "Accepted publickey", "Starting session"), and per validate
             step (the transport instrumented in-process).
  warm       one host, side by side, interleaved: bare `rsync` alone (the seed's command), `invoke
             deploy` with its warm connection (no change), the same with --no-persist, and a no-op
             `invoke validate --skip bench` (warm); each as a ratio to the bare rsync of that run.
             Also, each alone, what any warm `invoke deploy` must do (`bound:` rows): `invoke
             --list`, the key probe, rsync over the warm master with no change; their sum bounds
             a warm no-change deploy from below.
             Use --files 0 for the real engine tree.
  scale      `invoke doctor` and a warm `invoke deploy` on every --hosts count: peak open file
             descriptors and peak memory (RSS) of the invoke process, of its whole process tree,
             and of the warm masters it leaves (ssh -O check), sampled from /proc every 20 ms.

It prints a table of figures and ratios and writes them as JSON (--json). Loopback only: every
host is 127.0.0.1; the client never reads ~/.ssh (the lab's ssh config and known_hosts files).
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import platform
import random
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
ENGINE = REPO / "engine_src"
ANSIBLE_PIN = "ansible==10.7.0"          # ansible-core 2.17 + the collections, ansible.posix included


def _load_sshd():
    spec = importlib.util.spec_from_file_location("kdtree_bench_sshd", REPO / "tests" / "sshd.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sshd = _load_sshd()


# -- set-up -----------------------------------------------------------------------------------------
def make_source(work: Path, files: int, engine: Path = ENGINE, name: str = "src") -> Path:
    """`engine` (engine_src/, without build outputs and bundles) plus `files` synthetic files in 60 folders."""
    src = work / name
    if src.exists():
        shutil.rmtree(src)
    shutil.copytree(engine, src, symlinks=True, ignore=shutil.ignore_patterns(
        "build", "__pycache__", "*.pyc", "model_*.kdtr", "manifest.json", ".kdtree"))
    rng = random.Random(1234)
    for i in range(files):
        path = src / "synthetic" / f"d{i % 60:02d}" / f"f{i:05d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        size = rng.choice((200, 600, 1500, 4000, 9000))
        path.write_bytes(rng.randbytes(size // 2).hex().encode())
    return src


def project_excludes() -> list[str]:
    return list(yaml.safe_load((REPO / "hosts.yaml").read_text())["project"]["excludes"])


def write_inventory(work: Path, name: str, lab, hosts, source: Path, subdir: str, repo: Path = REPO, **entry) -> Path:
    """An inventory like the one `repo` ships (its keys are the ones that checkout knows): the
    project pointed at `source`, one entry per lab host with remote_dir <host root>/<subdir>."""
    data = yaml.safe_load((repo / "hosts.yaml").read_text())
    data["project"]["source"] = str(source)
    data["hosts"] = {h.name: lab.inventory_entry(h, remote_dir=str(h.root / subdir), **entry) for h in hosts}
    data.pop("groups", None)
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def host_flags(hosts) -> list[str]:
    return [a for h in hosts for a in ("--host", h.name)]


class Runner:
    """Runs one command (or one per host, in parallel) and times it; a failure stops the benchmark."""

    def __init__(self, lab, work: Path, verbose: bool):
        self.lab, self.work, self.verbose = lab, work, verbose
        self.env = {**os.environ, **lab.env()}

    last_cpu = 0.0       # CPU seconds of the last command's process tree on the client (not the sshd side)

    last_machine_cpu = 0.0   # CPU seconds of the whole machine meanwhile (sshd side and other load included)

    @staticmethod
    def _children_cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    @staticmethod
    def _machine_cpu() -> float:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")     # all but idle, iowait

    def run(self, argv, *, cwd=REPO, env=None, what="") -> float:
        cpu, machine = self._children_cpu(), self._machine_cpu()
        start = time.perf_counter()
        proc = subprocess.run(argv, cwd=cwd, env=env or self.env, capture_output=True, text=True, timeout=1800)
        seconds = time.perf_counter() - start
        self.last_cpu, self.last_machine_cpu = self._children_cpu() - cpu, self._machine_cpu() - machine
        if proc.returncode != 0:
            raise SystemExit(f"benchmark command failed ({what}): {shlex.join(map(str, argv))}\n"
                             f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        if self.verbose:
            print(f"    {what}: {seconds:.3f} s", file=sys.stderr)
        return seconds

    def run_parallel(self, argvs, *, what="") -> float:
        """Every argv at once (one process per host, as `cmd & cmd & wait`); wall time."""
        cpu, machine = self._children_cpu(), self._machine_cpu()
        start = time.perf_counter()
        procs = [subprocess.Popen(a, cwd=REPO, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True) for a in argvs]
        outs = [p.communicate(timeout=1800)[0] for p in procs]
        seconds = time.perf_counter() - start
        self.last_cpu, self.last_machine_cpu = self._children_cpu() - cpu, self._machine_cpu() - machine
        for p, out, argv in zip(procs, outs, argvs):
            if p.returncode != 0:
                raise SystemExit(f"benchmark command failed ({what}): {shlex.join(map(str, argv))}\n"
                                 f"exit {p.returncode}\n{out[-3000:]}")
        if self.verbose:
            print(f"    {what}: {seconds:.3f} s", file=sys.stderr)
        return seconds


# -- the three ways to deploy -----------------------------------------------------------------------
class Invoke:
    name = "invoke"

    def __init__(self, runner: Runner, inventory: Path, subdir: str):
        self.runner, self.inventory, self.subdir = runner, inventory, subdir

    def deploy(self, hosts) -> float:
        return self.runner.run([sys.executable, "-m", "invoke", "deploy", "--inventory", str(self.inventory),
                                *host_flags(hosts)], what=f"invoke deploy x{len(hosts)}")

    def doctor(self, hosts) -> float:
        return self.runner.run([sys.executable, "-m", "invoke", "doctor", "--inventory", str(self.inventory),
                                *host_flags(hosts)], what=f"invoke doctor x{len(hosts)}")


class Bare:
    """What a careful engineer types: rsync over ssh with the pinned known_hosts, then the tree hash."""
    name = "bare"

    def __init__(self, runner: Runner, lab, source: Path, subdir: str):
        self.runner, self.lab, self.source, self.subdir = runner, lab, source, subdir

    def ssh(self) -> list[str]:
        return ["ssh", "-F", str(self.lab.ssh_config), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                "-o", f"UserKnownHostsFile={self.lab.known_hosts}"]

    def rsync_argv(self, host) -> list[str]:
        """The seed's deploy: rsync alone."""
        return ["rsync", "-az", "--delete", "--exclude=/.kdtree/", *[f"--exclude={p}" for p in project_excludes()],
                "-e", shlex.join(self.ssh()), f"{self.source}/", f"{host.name}:{host.root / self.subdir}/"]

    def argv(self, host) -> list[str]:
        remote_dir = host.root / self.subdir
        rsync = self.rsync_argv(host)
        hash_ = self.ssh() + [host.name, f"cd {shlex.quote(str(remote_dir))} && bash scripts/tree_hash.sh"]
        return ["bash", "-c", f"{shlex.join(rsync)} && {shlex.join(hash_)}"]

    def deploy(self, hosts) -> float:
        if len(hosts) == 1:
            return self.runner.run(self.argv(hosts[0]), what="bare deploy x1")
        return self.runner.run_parallel([self.argv(h) for h in hosts], what=f"bare deploy x{len(hosts)}")

    def doctor(self, hosts) -> float:
        """The cheap remote step by hand: one ssh per host running a trivial probe."""
        argvs = [self.ssh() + [h.name, "command -v rsync && df -Pk ."] for h in hosts]
        return self.runner.run_parallel(argvs, what=f"bare probe x{len(hosts)}")


class Ansible:
    """ansible-playbook with ansible.posix.synchronize (rsync --delete, the same excludes) and a
    shell task for the tree hash, on the same hosts, keys verified against the lab's known_hosts."""
    name = "ansible"

    def __init__(self, runner: Runner, lab, work: Path, source: Path, subdir: str, venv: Path | None):
        self.runner, self.lab, self.source, self.subdir = runner, lab, source, subdir
        self.dir = work / "ansible"
        self.dir.mkdir(exist_ok=True)
        self.venv = venv or work / "ansible-venv"
        self.version = ""

    def install(self) -> None:
        bin_ = self.venv / "bin" / "ansible-playbook"
        if not bin_.exists():
            print(f"installing {ANSIBLE_PIN} into {self.venv} (pip, once)", file=sys.stderr)
            subprocess.run([sys.executable, "-m", "venv", str(self.venv)], check=True)
            subprocess.run([str(self.venv / "bin" / "pip"), "install", "-q", ANSIBLE_PIN], check=True)
        out = subprocess.run([str(self.venv / "bin" / "ansible"), "--version"], capture_output=True, text=True)
        self.version = out.stdout.splitlines()[0] if out.stdout else "?"
        collections_dir = next((self.venv / "lib").glob("python*/site-packages/ansible_collections"))
        if not (collections_dir / "ansible" / "posix" / "plugins" / "modules" / "synchronize.py").exists():
            raise SystemExit("ansible.posix.synchronize is not installed in the Ansible venv")
        self._write_files()

    def _write_files(self) -> None:
        lines = ["[nodes]"]
        for h in self.lab.hosts.values():
            lines.append(f"{h.name} ansible_host={sshd.LOOPBACK} ansible_port={h.port} ansible_user=root "
                         f"ansible_ssh_private_key_file={self.lab.client_key} remote_dir={h.root / self.subdir}")
        (self.dir / "inventory.ini").write_text("\n".join(lines) + "\n")
        play = [{
            "hosts": "nodes", "gather_facts": False,
            "tasks": [
                {"name": "sync the engine source", "ansible.posix.synchronize": {
                    "src": f"{self.source}/", "dest": "{{ remote_dir }}/", "delete": True, "archive": True,
                    "compress": True, "use_ssh_args": True,
                    "rsync_opts": ["--exclude=/.kdtree/", *[f"--exclude={p}" for p in project_excludes()]]}},
                {"name": "hash the deployed tree", "ansible.builtin.shell": "bash scripts/tree_hash.sh",
                 "args": {"chdir": "{{ remote_dir }}"}, "changed_when": False},
            ]}]
        (self.dir / "deploy.yml").write_text(yaml.safe_dump(play, sort_keys=False))
        self.env = {**self.runner.env,
                    "ANSIBLE_HOME": str(self.dir / "home"), "ANSIBLE_LOCAL_TEMP": str(self.dir / "tmp"),
                    "ANSIBLE_REMOTE_TEMP": "/tmp/.ansible-bench", "ANSIBLE_HOST_KEY_CHECKING": "True",
                    "ANSIBLE_SSH_CONTROL_PATH_DIR": str(self.dir / "cp"), "ANSIBLE_FORKS": "16",
                    "ANSIBLE_PYTHON_INTERPRETER": sys.executable, "ANSIBLE_RETRY_FILES_ENABLED": "False",
                    "ANSIBLE_NOCOLOR": "1",
                    # Ansible's default ssh args (ControlMaster/Persist) plus the lab's known_hosts, checked strictly
                    "ANSIBLE_SSH_ARGS": f"-C -o ControlMaster=auto -o ControlPersist=60s -o StrictHostKeyChecking=yes "
                                        f"-o UserKnownHostsFile={self.lab.known_hosts}"}

    def deploy(self, hosts) -> float:
        return self.runner.run([str(self.venv / "bin" / "ansible-playbook"), "-i", str(self.dir / "inventory.ini"),
                                str(self.dir / "deploy.yml"), "--limit", ",".join(h.name for h in hosts)],
                               env=self.env, what=f"ansible deploy x{len(hosts)}")

    def stop_masters(self) -> None:
        """End Ansible's persistent ssh masters (ControlPersist) so they do not outlive the lab."""
        for sock in (self.dir / "cp").glob("*"):
            subprocess.run(["ssh", "-o", f"ControlPath={sock}", "-O", "exit", "x"], capture_output=True)


def change_one_file(source: Path, counter: list) -> None:
    counter[0] += 1
    path = source / "synthetic" / "d00" / "f00000.txt"     # with --files 0, a file of its own
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"changed {counter[0]} at {time.time()}\n")


def reset(hosts, subdir: str) -> None:
    for h in hosts:
        shutil.rmtree(h.root / subdir, ignore_errors=True)


# -- counts from the sshd logs ----------------------------------------------------------------------
class SshdCounter:
    """Connections ("Accepted publickey") and sessions ("Starting session") per host since mark()."""

    def __init__(self, hosts):
        self.hosts = hosts
        self.offsets = {}

    def mark(self) -> None:
        self.offsets = {h.name: h.log_path.stat().st_size for h in self.hosts}

    def read(self) -> dict:
        time.sleep(0.3)       # sshd writes its log lines as the sessions end
        result = {}
        for h in self.hosts:
            with open(h.log_path, "rb") as f:
                f.seek(self.offsets.get(h.name, 0))
                text = f.read().decode(errors="replace")
            result[h.name] = {"connections": text.count("Accepted publickey"),
                              "sessions": text.count("Starting session")}
        return result


def per_host(counts: dict) -> dict:
    n = len(counts) or 1
    return {k: sum(c[k] for c in counts.values()) / n for k in ("connections", "sessions")}


# -- sections ---------------------------------------------------------------------------------------
def median(values):
    return round(statistics.median(values), 3) if values else None


def bench_deploy(tools, host, subdir_of, repeats, source) -> dict:
    """cold / warm / one changed file, per tool, interleaved repeat by repeat."""
    times = {t.name: collections.defaultdict(list) for t in tools}
    counter = [0]
    for r in range(repeats):
        for tool in tools:
            reset([host], subdir_of[tool.name])
            for case in ("cold", "warm", "changed"):
                if case == "changed":
                    change_one_file(source, counter)
                times[tool.name][case].append(tool.deploy([host]))
                times[tool.name][f"{case}_client_cpu"].append(tool.runner.last_cpu)
            # every tool sees the same change: put it back for the next tool
        print(f"  deploy repeat {r + 1}/{repeats}: " + ", ".join(
            f"{t.name} {times[t.name]['warm'][-1]:.2f}" for t in tools) + " s warm", file=sys.stderr)
    return {name: {k: {"median": median(v), "runs": [round(x, 3) for x in v]} for k, v in by.items()}
            for name, by in times.items()}


def bench_warm(runner: Runner, work: Path, lab, host, source: Path, repeats: int, baselines: tuple[Path, ...] = (),
               validate_engine: Path | None = None) -> dict:
    """Warm no-change deploy and a no-op `validate --skip bench`, against bare rsync alone, one host;
    with `baselines` (other checkouts of the project) their deploy and validate too, interleaved,
    each labelled with its folder's name. Each checkout validates its own engine_src, or every one
    `validate_engine` (an engine tree they all know: the same work for every orchestrator)."""
    bare = Bare(runner, lab, source, "warm-bare")
    cases: dict[str, tuple[list, Path]] = {"bare rsync": (bare.rsync_argv(host), REPO)}
    # both checkouts deploy to the same remote_dir; each validates its own (the engine's outputs.json
    # holds its speed: one checkout's golden run would make the other's stamped outputs another file)
    invoke = [sys.executable, "-m", "invoke"]
    for i, (label, repo) in enumerate([*((f" ({b.name})", b) for b in baselines), ("", REPO)]):
        subdir = f"warmvalbase{i}" if label else "warmval"
        # each checkout validates its own engine_src: a no-op validate is judged against the manifest
        # and bundle tiers of the engine its orchestrator was written for
        if validate_engine is not None:
            checked = make_source(work, 0, validate_engine, f"src-validate{i}")
        else:
            checked = make_source(work, 0, repo / "engine_src", f"src-baseline{i}") if label else source
        validate_inv = write_inventory(work, subdir, lab, [host], checked, subdir, repo, persist=600, backend="cpu")
        deploy_inv = write_inventory(work, f"warmbase{i}" if label else "warm", lab, [host], source, "warm", repo,
                                     persist=600)
        cases |= {
            f"invoke deploy (warm){label}": (invoke + ["deploy", "--inventory", str(deploy_inv), "--host", host.name], repo),
            f"invoke deploy --no-persist{label}": (invoke + ["deploy", "--inventory", str(deploy_inv), "--host", host.name,
                                                             "--no-persist"], repo),
            f"invoke validate --skip bench (no-op, warm){label}": (
                invoke + ["validate", "--inventory", str(validate_inv), "--host", host.name, "--skip", "bench",
                          "--report-dir"], repo)}
    cases |= floor_cases(deploy_inv, lab, host, bare, invoke)
    for name, (argv, repo) in cases.items():       # bring every target up to date (not timed): a full validate builds
        runner.run(argv + ([str(work / "runs" / f"warm-settle-{list(cases).index(name)}")] if argv[-1] == "--report-dir" else []),
                   cwd=repo, what=f"settle {name}")
    times: dict = collections.defaultdict(list)
    cpu: dict = collections.defaultdict(list)      # client CPU seconds (the command's process tree)
    for r in range(repeats):
        for name, (argv, repo) in cases.items():
            extra = [str(work / "runs" / f"warm-{r}-{list(cases).index(name)}")] if argv[-1] == "--report-dir" else []
            times[name].append(runner.run(argv + extra, cwd=repo, what=name))
            cpu[name].append(runner.last_cpu)
        print(f"  warm repeat {r + 1}/{repeats}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in times.items()),
              file=sys.stderr)
    base = median(times["bare rsync"])
    result = {name: {"median": median(v), "runs": [round(x, 3) for x in v], "ratio_to_bare_rsync":
                     round(median(v) / base, 2), "client_cpu": median(cpu[name])} for name, v in times.items()}
    bound = sum(result[name]["median"] for name in result if name.startswith(FLOOR))
    result[f"{FLOOR} sum: a warm deploy's lower bound"] = {"median": round(bound, 3), "runs": [],
                                                           "ratio_to_bare_rsync": round(bound / base, 2), "client_cpu": "-"}
    return result


FLOOR = "bound:"


def floor_cases(inventory: Path, lab, host, bare, invoke: list[str]) -> dict[str, tuple[list, Path]]:
    """What any `invoke deploy` with a warm connection must do, each alone: start the interpreter
    with Invoke and the tasks (`invoke --list`), probe the host key (every run does, before its
    first command: a live master would hide a changed key), and rsync over the warm master with
    nothing to send. Their sum bounds a warm no-change deploy from below, whatever else it does."""
    sys.path.insert(0, str(REPO))
    os.environ.update(lab.env())        # the lab's ssh config, known_hosts and socket directory, as the runs see them
    from orchestrator import inventory as inventory_mod
    from orchestrator.connectors import openssh as warm
    entry = inventory_mod.load(inventory).hosts[host.name]
    probe = warm._base_argv(entry) + ["-o", "ControlPath=none", "-o", f"KexAlgorithms={warm.PROBE_KEX}", "-o",
                                      f"PreferredAuthentications={warm.PROBE_METHOD}", str(entry.address), "true"]
    over_master = shlex.join(warm.client_argv(entry, warm.socket_path(entry))[:-1])
    rsync = bare.rsync_argv(host)
    rsync[rsync.index("-e") + 1] = over_master
    rsync[-1] = f"{host.name}:{host.root / 'warm-bound'}/"
    # the key probe is refused for want of an authentication method (255): that is its success
    return {f"{FLOOR} invoke --list (interpreter, Invoke, tasks)": (invoke + ["--list"], REPO),
            f"{FLOOR} key probe": (["bash", "-c", f"{shlex.join(probe)} 2>&1 | grep -q 'Permission denied'"], REPO),
            f"{FLOOR} rsync over the warm master, no change": (rsync, REPO)}


class Sampler:
    """Peak open fds and RSS of a process and of its process tree, from /proc, while it runs."""

    def __init__(self, pid: int):
        self.pid, self.peak = pid, {"fds": 0, "rss_mib": 0.0, "tree_fds": 0, "tree_rss_mib": 0.0, "tree_processes": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _children() -> dict:
        kids = collections.defaultdict(list)
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                try:
                    ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                kids[ppid].append(int(proc.name))
        return kids

    @staticmethod
    def _one(pid: int) -> tuple[int, float]:
        try:
            fds = len(os.listdir(f"/proc/{pid}/fd"))
            rss = next(int(l.split()[1]) for l in Path(f"/proc/{pid}/status").read_text().splitlines()
                       if l.startswith("VmRSS:")) / 1024
            return fds, rss
        except (OSError, StopIteration):
            return 0, 0.0

    def _run(self) -> None:
        while not self._stop.is_set():
            kids, tree, todo = self._children(), [], [self.pid]
            while todo:
                pid = todo.pop()
                tree.append(pid)
                todo += kids.get(pid, [])
            fds, rss = self._one(self.pid)
            sizes = [self._one(p) for p in tree]
            now = {"fds": fds, "rss_mib": rss, "tree_fds": sum(f for f, _ in sizes),
                   "tree_rss_mib": sum(r for _, r in sizes), "tree_processes": len(tree)}
            self.peak = {k: max(v, now[k]) for k, v in self.peak.items()}
            time.sleep(0.02)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return {k: round(v, 1) for k, v in self.peak.items()}


def bench_scale(runner: Runner, inventory: Path, lab, counts_list) -> dict:
    """Peak fds and memory of doctor and of a warm deploy per host count, and the masters left."""
    hosts_all = list(lab.hosts.values())
    result = {}
    for n in counts_list:
        flags = host_flags(hosts_all[:n])
        row = {}
        for what, extra in (("doctor", ["doctor"]), ("deploy (first)", ["deploy"]), ("deploy warm", ["deploy"]),
                            ("deploy --no-persist", ["deploy", "--no-persist"])):
            start = time.perf_counter()
            proc = subprocess.Popen([sys.executable, "-m", "invoke", *extra, "--inventory", str(inventory), *flags],
                                    cwd=REPO, env=runner.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            sampler = Sampler(proc.pid)
            out = proc.communicate(timeout=1800)[0]
            peak = sampler.stop()
            if proc.returncode != 0:
                raise SystemExit(f"scale: invoke {what} on {n} hosts failed ({proc.returncode}):\n{out[-3000:]}")
            row[what] = {"seconds": round(time.perf_counter() - start, 2), **peak}
        masters = [p for p in Sampler._children().get(1, []) if _is_master(p)]
        row["masters"] = {"count": len(masters), "rss_mib_total": round(sum(Sampler._one(p)[1] for p in masters), 1)}
        result[n] = row
        print(f"  scale x{n}: " + ", ".join(f"{k} {v}" for k, v in row.items()), file=sys.stderr)
    return result


def _is_master(pid: int) -> bool:
    try:
        return b"ControlMaster=yes" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def bench_validate(runner: Runner, work: Path, lab, host, source: Path, repeats: int, full_repeats: int) -> dict:
    inventory = write_inventory(work, "validate", lab, [host], source, "validate", backend="cpu")
    full, noop = [], []
    for r in range(full_repeats):
        reset([host], "validate")
        full.append(runner.run([sys.executable, "-m", "invoke", "validate", "--inventory", str(inventory),
                                "--host", host.name, "--report-dir", str(work / "runs" / f"full-{r}")],
                               what="validate full"))
        for i in range(repeats):
            noop.append(runner.run([sys.executable, "-m", "invoke", "validate", "--inventory", str(inventory),
                                    "--host", host.name, "--report-dir", str(work / "runs" / f"noop-{r}-{i}")],
                                   what="validate no-op"))
        print(f"  validate {r + 1}/{full_repeats}: full {full[-1]:.1f} s, no-op {noop[-1]:.2f} s", file=sys.stderr)
    run = json.loads((work / "runs" / f"noop-{full_repeats - 1}-{repeats - 1}" / "run.json").read_text())
    steps = {s: v["status"] for s, v in run["hosts"][host.name]["steps"].items()}
    step_seconds = {s: v["seconds"] for s, v in run["hosts"][host.name]["steps"].items()}
    full_run = json.loads((work / "runs" / f"full-{full_repeats - 1}" / "run.json").read_text())
    full_steps = {s: v["seconds"] for s, v in full_run["hosts"][host.name]["steps"].items()}
    return {"full": {"median": median(full), "runs": [round(x, 3) for x in full], "step_seconds": full_steps},
            "noop": {"median": median(noop), "runs": [round(x, 3) for x in noop], "steps": steps,
                     "step_seconds": step_seconds},
            "inventory": str(inventory)}


def bench_fanout(tools_by_name, lab, counts_list, repeats, source) -> dict:
    hosts_all = list(lab.hosts.values())
    result = {}
    counter = [1000]
    for tool_name, tool in tools_by_name.items():
        result[tool_name] = {}
        for n in counts_list:
            hosts = hosts_all[:n]
            tool.deploy(hosts)            # bring every host up to date (not timed)
            warm, changed, doctor, cpu, machine = [], [], [], [], []
            for _ in range(repeats):
                warm.append(tool.deploy(hosts))
                cpu.append(tool.runner.last_cpu)
                machine.append(tool.runner.last_machine_cpu)
                change_one_file(source, counter)
                changed.append(tool.deploy(hosts))
                doctor.append(tool.doctor(hosts))
            result[tool_name][n] = {"warm": median(warm), "changed": median(changed), "doctor": median(doctor),
                                    "warm_client_cpu": median(cpu), "warm_machine_cpu": median(machine)}
            print(f"  fanout {tool_name} x{n}: warm {median(warm):.2f} s (client CPU {median(cpu):.2f} s), "
                  f"changed {median(changed):.2f} s, doctor {median(doctor):.2f} s", file=sys.stderr)
    for by_n in result.values():
        base = by_n[counts_list[0]]
        for row in by_n.values():
            row["ratio"] = {k: round(row[k] / base[k], 2) for k in ("warm", "changed", "doctor")}
    return result


def bench_counts(tools, lab, host, source, validate_inventory: Path | None) -> dict:
    counter = SshdCounter([host])
    result = {}
    change = [5000]
    for tool in tools:
        tool.deploy([host])
        counter.mark()
        tool.deploy([host])
        warm = per_host(counter.read())
        change_one_file(source, change)
        counter.mark()
        tool.deploy([host])
        changed = per_host(counter.read())
        result[tool.name] = {"deploy_warm": warm, "deploy_changed": changed}
    if "invoke" in {t.name for t in tools}:
        inv = next(t for t in tools if t.name == "invoke")
        counter.mark()
        inv.doctor([host])
        result["invoke"]["doctor"] = per_host(counter.read())
    if validate_inventory is not None:
        result["validate_steps"] = validate_round_trips(lab, validate_inventory, host)
    return result


def validate_round_trips(lab, inventory: Path, host) -> dict:
    """A no-op validate in this process, the transport instrumented: sessions (round trips) per step,
    Paramiko connections, rsync/ssh subprocesses."""
    sys.path.insert(0, str(REPO))
    from orchestrator import cli, sync as sync_mod
    from orchestrator.runner import pipeline
    from orchestrator.connectors import paramiko as connection_mod
    from orchestrator.runner.console import Console
    import io

    local = threading.local()
    counts = collections.defaultdict(lambda: collections.Counter())
    orig_exec, orig_open = connection_mod.SshTransport._exec, connection_mod._open_once
    orig_step, orig_run = pipeline._run_step, subprocess.run

    def step_of():
        return getattr(local, "step", "(outside steps)")

    def exec_(self, *a, **k):
        counts[step_of()]["sessions"] += 1
        return orig_exec(self, *a, **k)

    def open_(host):
        counts[step_of()]["connections"] += 1
        return orig_open(host)

    def run_step(ctx, run, step, out):
        local.step = step
        try:
            return orig_step(ctx, run, step, out)
        finally:
            local.step = "(between steps)"

    def run(argv, *a, **k):
        if isinstance(argv, list) and argv and argv[0] in ("rsync", "ssh"):
            counts[step_of()][f"{argv[0]} processes"] += 1
        return orig_run(argv, *a, **k)

    with lab.environment():         # bring the host up to date first (not counted): the counted run is a no-op
        inv, selected = cli.load_selection(str(inventory), [host.name])
        cli.validate(inv, selected, Console(io.StringIO()), report_dir=str(inventory.parent / "runs" / "settle"))
    connection_mod.SshTransport._exec, connection_mod._open_once = exec_, open_
    pipeline._run_step, sync_mod.subprocess.run = run_step, run
    try:
        with lab.environment():
            cli.validate(inv, selected, Console(io.StringIO()), report_dir=str(inventory.parent / "runs" / "counted"))
    finally:
        connection_mod.SshTransport._exec, connection_mod._open_once = orig_exec, orig_open
        pipeline._run_step, sync_mod.subprocess.run = orig_step, orig_run
    return {step: dict(c) for step, c in counts.items()}


def startup(runner: Runner) -> dict:
    """`invoke --list` (start-up and task import, nothing remote) and `python3 -c pass`."""
    py = [runner.run([sys.executable, "-c", "pass"], what="python") for _ in range(5)]
    lst = [runner.run([sys.executable, "-m", "invoke", "--list"], what="invoke --list") for _ in range(5)]
    return {"python": median(py), "invoke_list": median(lst)}


# -- output -----------------------------------------------------------------------------------------
def machine() -> dict:
    def first(cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True).stdout.splitlines()[0]
        except (OSError, IndexError):
            return "?"
    cpu = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                if l.startswith("model name")), "?")
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "kernel": platform.release(), "ssh": subprocess.run(["ssh", "-V"], capture_output=True,
                                                                 text=True).stderr.strip(),
            "rsync": first(["rsync", "--version"]), "memory_gb": round(os.sysconf("SC_PAGE_SIZE") *
                                                                     os.sysconf("SC_PHYS_PAGES") / 2**30, 1)}


def table(header, rows) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*["-" * w for w in widths])] +
                     [fmt.format(*map(str, r)) for r in rows])


def ratio(a, b):
    return f"{a / b:.2f}x" if a and b else "-"


def report(results: dict) -> str:
    out = [f"{results['machine']['cores']} cores, load average (1, 5, 15 min) {results.get('load_at_start')} at the "
           f"start, {results.get('load_at_finish')} at the end", ""]
    if "startup" in results:
        s = results["startup"]
        out += ["start-up", table(["what", "median s"], [["python3 -c pass", s["python"]],
                                                          ["python3 -m invoke --list", s["invoke_list"]]]), ""]
    if "deploy" in results:
        d = results["deploy"]
        rows = []
        for case in ("cold", "warm", "changed"):
            bare = d.get("bare", {}).get(case, {}).get("median")
            inv = d.get("invoke", {}).get(case, {}).get("median")
            ans = d.get("ansible", {}).get(case, {}).get("median")
            cpu = [d.get(t, {}).get(f"{case}_client_cpu", {}).get("median") for t in ("bare", "invoke", "ansible")]
            rows.append([case, bare, inv, ans if ans is not None else "-", ratio(inv, bare), ratio(ans, inv),
                         " / ".join("-" if c is None else f"{c:.2f}" for c in cpu)])
        out += [f"deploy, one host, {results['source']['files']} files ({results['source']['mb']} MB), "
                f"median of {results['repeats']} (seconds)",
                table(["case", "bare rsync+ssh", "invoke deploy", "ansible", "invoke/bare", "ansible/invoke",
                       "client CPU s bare/invoke/ansible"], rows),
                "targets: warm invoke/bare <= 1.5x; ansible/invoke >= 2x", ""]
    if "validate" in results:
        v = results["validate"]
        out += ["validate, one host, CPU backend (seconds)",
                table(["run", "median", "runs"], [["full (empty host)", v["full"]["median"], v["full"]["runs"]],
                                                  ["no-op (nothing changed)", v["noop"]["median"], v["noop"]["runs"]]]),
                f"full/no-op: {ratio(v['full']['median'], v['noop']['median'])} (target >= 10x); "
                f"no-op steps: {v['noop']['steps']}",
                f"no-op step seconds: {v['noop']['step_seconds']}",
                f"full step seconds: {v['full']['step_seconds']}", ""]
    if "fanout" in results:
        rows = []
        for tool, by_n in results["fanout"].items():
            for n, row in by_n.items():
                rows.append([tool, n, row["warm"], row["ratio"]["warm"], row["warm_client_cpu"],
                             f"{row['warm_machine_cpu'] / row['warm'] / os.cpu_count():.0%}", row["changed"],
                             row["ratio"]["changed"], row["doctor"], row["ratio"]["doctor"]])
        out += ["fan-out (seconds, ratio to the first host count; client CPU: the command's own process tree,"
                " not the sshd side, which shares this machine's cores; machine busy: all cores, warm deploy)",
                table(["tool", "hosts", "warm deploy", "ratio", "client CPU", "machine busy", "1 changed", "ratio",
                       "doctor/probe", "ratio"], rows),
                "targets (issue 20): 16 hosts within 1.2x of one host; 64 hosts no worse, as a ratio, than 64 bare rsyncs; doctor at 16 hosts within 2x of one", ""]
    if "warm" in results:
        rows = [[k, v["median"], v["ratio_to_bare_rsync"], v["client_cpu"], v["runs"]] for k, v in results["warm"].items()]
        out += [f"warm connections, one host, {results['source']['files']} files (seconds, median of {results['repeats']})",
                table(["command", "median s", "/ bare rsync", "client CPU s", "runs"], rows),
                "targets: warm deploy <= 1.0x bare rsync; no-op validate --skip bench <= 3x bare rsync", ""]
    if "scale" in results:
        rows = []
        for n, row in results["scale"].items():
            for what in ("doctor", "deploy (first)", "deploy warm", "deploy --no-persist"):
                r = row[what]
                rows.append([n, what, r["seconds"], r["fds"], r["rss_mib"], r["tree_processes"], r["tree_fds"],
                             r["tree_rss_mib"]])
            rows.append([n, "masters left", "-", "-", "-", row["masters"]["count"], "-", row["masters"]["rss_mib_total"]])
        out += ["scale: peaks while the command ran (invoke process, then its whole process tree)",
                table(["hosts", "command", "seconds", "fds", "RSS MiB", "processes", "tree fds", "tree RSS MiB"], rows), ""]
    if "counts" in results:
        rows = []
        for tool, by in results["counts"].items():
            if tool == "validate_steps":
                continue
            for case, c in by.items():
                rows.append([tool, case, c["connections"], c["sessions"]])
        out += ["ssh connections and sessions per host per run (sshd logs)",
                table(["tool", "run", "connections", "sessions"], rows)]
        if results["counts"].get("validate_steps"):
            rows = [[step, c.get("connections", 0), c.get("sessions", 0), c.get("rsync processes", 0)]
                    for step, c in results["counts"]["validate_steps"].items()]
            out += ["", "no-op validate, per step (in-process count)",
                    table(["step", "paramiko connections", "sessions (round trips)", "rsync processes"], rows)]
        out.append("")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", default="1,4,8,16", help="host counts for the fan-out (comma list)")
    ap.add_argument("--repeats", type=int, default=5, help="runs per figure (the median is reported)")
    ap.add_argument("--validate-repeats", type=int, default=1, help="full validate runs (each followed by --repeats no-op runs)")
    ap.add_argument("--sections", default="startup,deploy,validate,fanout,counts")
    ap.add_argument("--files", type=int, default=3000, help="synthetic files added to the engine source")
    ap.add_argument("--work-dir", help="keep the lab, source copy, Ansible venv and runs here (default: a temp dir)")
    ap.add_argument("--ansible-venv", help="an existing venv with the ansible package (else installed)")
    ap.add_argument("--no-ansible", action="store_true")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--validate-engine", help="warm: the engine tree every checkout's no-op validate runs on "
                    "(default: each checkout's own engine_src; e.g. an earlier commit's, for the same work)")
    ap.add_argument("--baseline-repo", action="append", default=[],
                    help="warm: also time this checkout's deploy and validate (e.g. an earlier commit, `git archive "
                         "REV | tar -x -C DIR`), interleaved, labelled with DIR's name; may be given more than once")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    counts_list = [int(x) for x in args.hosts.split(",")]
    sections = set(args.sections.split(","))

    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="kdtree-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    lab_dir = work / "lab"
    shutil.rmtree(lab_dir, ignore_errors=True)
    print(f"work dir {work}", file=sys.stderr)
    source = make_source(work, args.files)
    nfiles = sum(1 for p in source.rglob("*") if p.is_file())
    mb = round(sum(p.stat().st_size for p in source.rglob("*") if p.is_file()) / 2**20, 1)
    cached = REPO / "build" / "local-bundles"
    if cached.is_dir() and not (work / "build" / "local-bundles").exists():
        shutil.copytree(cached, work / "build" / "local-bundles")     # this machine's reference, as in the repo

    lab = sshd.SshLab(lab_dir)
    results = {"machine": machine(), "repeats": args.repeats, "source": {"files": nfiles, "mb": mb},
               "hosts": counts_list, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "load_at_start": [round(x, 2) for x in os.getloadavg()],
               "git_revision": subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                              capture_output=True, text=True).stdout.strip()}
    ansible = None
    try:
        lab.add_hosts(max(counts_list), "node")
        hosts = list(lab.hosts.values())
        runner = Runner(lab, work, args.verbose)
        invoke_inv = write_inventory(work, "deploy", lab, hosts, source, "invoke", persist=600)
        tools = [Bare(runner, lab, source, "bare"), Invoke(runner, invoke_inv, "invoke")]
        subdirs = {"bare": "bare", "invoke": "invoke", "ansible": "ansible"}
        if not args.no_ansible and sections & {"deploy", "counts"}:
            ansible = Ansible(runner, lab, work, source, "ansible",
                              Path(args.ansible_venv) if args.ansible_venv else None)
            ansible.install()
            results["ansible_version"] = ansible.version
            tools.append(ansible)
        if "startup" in sections:
            results["startup"] = startup(runner)
        if "deploy" in sections:
            results["deploy"] = bench_deploy(tools, hosts[0], subdirs, args.repeats, source)
        if "validate" in sections:
            results["validate"] = bench_validate(runner, work, lab, hosts[0], source, args.repeats,
                                                 args.validate_repeats)
        if "fanout" in sections:
            results["fanout"] = bench_fanout({t.name: t for t in tools if t.name in ("invoke", "bare")}, lab,
                                             counts_list, args.repeats, source)
        if "warm" in sections:
            results["validate_engine"] = args.validate_engine or "each checkout's own engine_src"
            results["warm"] = bench_warm(runner, work, lab, hosts[0], source, args.repeats,
                                         tuple(Path(b) for b in args.baseline_repo),
                                         Path(args.validate_engine) if args.validate_engine else None)
        if "scale" in sections:
            results["scale"] = bench_scale(runner, invoke_inv, lab, counts_list)
        if "counts" in sections:
            validate_inv = write_inventory(work, "validate", lab, [hosts[0]], source, "validate", backend="cpu")
            results["counts"] = bench_counts(tools, lab, hosts[0], source, validate_inv)
    finally:
        if ansible is not None:
            ansible.stop_masters()
        lab.close()         # also ends the warm masters under the lab's control directory
    results["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    results["load_at_finish"] = [round(x, 2) for x in os.getloadavg()]     # 1, 5, 15 min: read the figures with it
    print(report(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
