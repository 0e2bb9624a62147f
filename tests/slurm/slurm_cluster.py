"""A real single-machine Slurm cluster for tests: Debian's slurm-wlm (22.05) with munge, every file
under one folder, its ports on 127.0.0.1 only.

    cluster = SlurmCluster(tmp_dir).start()     # munged, slurmctld -i, slurmd -D; waits for the node IDLE
    cluster.env()                               # {"SLURM_CONF": ...}: what a Slurm command needs
    cluster.scontrol("show", "job", "12")       # slurmctld's own view (CompletedProcess)
    cluster.job("12")                           # that view as a dict (JobState, Reason, ...)
    cluster.drain() / cluster.resume()          # the node drained (jobs wait: ReqNodeNotAvail) or back
    cluster.ctld_log()                          # slurmctld's log
    cluster.close()

What works as root on a 2-core machine (issue 41): munged with its own key and socket
(`AuthInfo=socket=...`); slurmctld `-i` (no state from an earlier cluster); slurmd `-D` in the
background (daemonized, its task launches time out); `GresTypes=gpu` with gres.conf `File=` naming
character devices made with mknod in the folder: a count-only gpu GRES leaves the node INVAL
("count reported lower than configured"), regular files register but set no CUDA_VISIBLE_DEVICES,
character devices give `CUDA_VISIBLE_DEVICES=0,1` for `--gres=gpu:2`. `missing()` says why a
cluster cannot run here (slurm-wlm or munge not installed, not root), for a skip with that reason.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from sshd import LOOPBACK, free_port

# Job states a job leaves on its own (`squeue --help`): a test that reads a job after its end waits them out.
UNENDED_STATES = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "RESIZING", "REQUEUED")

def soon(condition, within: float) -> bool:
    """Whether `condition()` holds within `within` seconds (slurmctld and slurmd act on their own time)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return False


DAEMONS = {"munged": "/usr/sbin/munged", "mungekey": "/usr/sbin/mungekey", "slurmctld": "/usr/sbin/slurmctld",
           "slurmd": "/usr/sbin/slurmd", "sbatch": "/usr/bin/sbatch"}
NODE = "kdnode1"
PARTITION = "gpu"
GPUS = 2
NODE_MEMORY = 512           # MiB the node offers jobs (a `mem` request's room; the machine has more)
NVIDIA_MAJOR = 195          # the nvidia driver's character device major (the devices are never opened)
START_TIMEOUT = 120


def missing() -> str | None:
    """Why a cluster cannot run on this machine, or None."""
    absent = [name for name, path in DAEMONS.items() if not os.access(path, os.X_OK)]
    if absent:
        return f"slurm-wlm and munge are not installed ({', '.join(absent)} missing): apt-get install slurm-wlm munge"
    if os.geteuid() != 0:
        return "a local Slurm cluster needs root (mknod for the GPU devices, slurmd)"
    return None


class SlurmCluster:
    """munged, slurmctld and one slurmd (node NODE, GPUS gpu GRES, partition PARTITION) in `base`."""

    def __init__(self, base: Path):
        self.dir = Path(base)
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)           # munged refuses a folder others may write to
        self.munge_socket = self.dir / "munge" / "munge.sock"
        self.conf = self.dir / "slurm.conf"
        self.ctld_port, self.node_port = free_port(), free_port()
        self.procs: dict[str, subprocess.Popen] = {}
        self.started_seconds: float | None = None

    # -- the files ---------------------------------------------------------------------------
    def _write_files(self) -> None:
        for sub in ("munge", "state", "spool", "dev", "log"):
            (self.dir / sub).mkdir(mode=0o700, exist_ok=True)
        key = self.dir / "munge" / "munge.key"
        if not key.exists():
            subprocess.run([DAEMONS["mungekey"], "--create", f"--keyfile={key}"], check=True, capture_output=True)
        devices = []
        for index in range(GPUS):
            dev = self.dir / "dev" / f"nvidia{index}"
            if not dev.exists():
                os.mknod(dev, 0o600 | 0o020000, os.makedev(NVIDIA_MAJOR, index))     # S_IFCHR
            devices.append(str(dev))
        (self.dir / "gres.conf").write_text(
            "".join(f"NodeName={NODE} Name=gpu File={dev}\n" for dev in devices))
        cpus = os.cpu_count() or 1
        log = self.dir / "log"
        self.conf.write_text("\n".join([
            "ClusterName=kdtest",
            f"SlurmctldHost={socket.gethostname().split('.')[0]}({LOOPBACK})",
            f"SlurmctldPort={self.ctld_port}", f"SlurmdPort={self.node_port}",
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={self.dir / 'state'}", f"SlurmdSpoolDir={self.dir / 'spool'}",
            f"SlurmctldPidFile={self.dir / 'slurmctld.pid'}", f"SlurmdPidFile={self.dir / 'slurmd.pid'}",
            f"SlurmctldLogFile={log / 'slurmctld.log'}", f"SlurmdLogFile={log / 'slurmd.log'}",
            "SlurmctldDebug=verbose", "SlurmdDebug=verbose",
            "ProctrackType=proctrack/pgid", "TaskPlugin=task/none", "MpiDefault=none", "SwitchType=switch/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill", "SchedulerParameters=sched_interval=2",
            "AccountingStorageType=accounting_storage/none", "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none", "ReturnToService=2", "GresTypes=gpu",
            "MinJobAge=600",        # finished jobs stay in `scontrol show job` for the session's checks
            "SlurmdTimeout=30", "InactiveLimit=0",
            # scancel's TERM, then KILL KillWait seconds later; a step still there UnkillableStepTimeout
            # seconds after the KILL drains the node ("Kill task failed"): on a loaded 2-core machine a
            # step's processes can take longer than the default 60 s to be reaped
            "KillWait=5", "UnkillableStepTimeout=180",
            f"NodeName={NODE} NodeHostname={socket.gethostname().split('.')[0]} NodeAddr={LOOPBACK} CPUs={cpus} "
            f"RealMemory={NODE_MEMORY} "
            f"Gres=gpu:{GPUS} Feature=sm_90,cuda12 State=UNKNOWN",
            f"PartitionName={PARTITION} Nodes={NODE} Default=YES MaxTime=INFINITE State=UP",
            ""]))

    def env(self) -> dict[str, str]:
        """What a Slurm command of this cluster needs in its environment."""
        return {"SLURM_CONF": str(self.conf)}

    # -- the daemons -------------------------------------------------------------------------
    def start(self) -> "SlurmCluster":
        """Start munged, slurmctld and slurmd, and wait until the node is IDLE (RuntimeError with
        the daemons' logs if it is not within START_TIMEOUT seconds)."""
        began = time.monotonic()
        self._write_files()
        munge = self.dir / "munge"
        self._spawn("munged", [DAEMONS["munged"], "-F", "--force", f"--socket={self.munge_socket}",
                               f"--key-file={munge / 'munge.key'}", f"--pid-file={munge / 'munged.pid'}",
                               f"--log-file={self.dir / 'log' / 'munged.log'}", f"--seed-file={munge / 'seed'}"])
        self._wait(lambda: self.munge_socket.exists(), "munged's socket")
        self._spawn("slurmctld", [DAEMONS["slurmctld"], "-D", "-i", "-f", str(self.conf)])
        self._wait(lambda: self.scontrol("ping").returncode == 0, "slurmctld to answer `scontrol ping`")
        self._spawn("slurmd", [DAEMONS["slurmd"], "-D", "-N", NODE, "-f", str(self.conf)])
        self._wait(lambda: self.node_state() == "IDLE", f"node {NODE} IDLE")
        self.started_seconds = round(time.monotonic() - began, 2)
        return self

    def _spawn(self, name: str, argv: list[str]) -> None:
        out = open(self.dir / "log" / f"{name}.out", "ab")
        self.procs[name] = subprocess.Popen(argv, stdout=out, stderr=out, stdin=subprocess.DEVNULL,
                                            env={**os.environ, **self.env()})
        out.close()

    def _wait(self, ready, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited ({proc.returncode}) while waiting for {what}:\n{self.logs()}")
            if ready():
                return
            time.sleep(0.2)
        raise RuntimeError(f"no {what} within {START_TIMEOUT} s:\n{self.logs()}")

    def close(self) -> None:
        """Cancel every job left and wait for them to end (their slurmstepd would outlive slurmd),
        then stop every daemon (slurmd first, munged last)."""
        ctld = self.procs.get("slurmctld")
        if ctld is not None and ctld.poll() is None:
            self.command("scancel", f"--partition={PARTITION}")
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and self.command("squeue", "-h", "-o", "%i").stdout.strip():
                time.sleep(0.2)
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.pop(name, None)
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)

    # -- slurmctld's side ---------------------------------------------------------------------
    def command(self, tool: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """A Slurm client command of this cluster, run here."""
        return subprocess.run([shutil.which(tool) or tool, *args], capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **self.env()})

    def scontrol(self, *args: str) -> subprocess.CompletedProcess:
        return self.command("scontrol", *args)

    def job(self, job_id: str) -> dict[str, str]:
        """slurmctld's record of a job (`scontrol -o show job`) as Key -> value; {} once forgotten."""
        proc = self.scontrol("-o", "show", "job", job_id)
        return dict(word.split("=", 1) for word in proc.stdout.split() if "=" in word) if proc.returncode == 0 else {}

    def ended_job(self, job_id: str, within: float = 30) -> dict[str, str]:
        """slurmctld's record of a job once it has ended (no longer pending, running or completing),
        or as it stands after `within` seconds: scancel and a job's end are asynchronous, so a record
        read at once can still say COMPLETING."""
        deadline = time.monotonic() + within
        while True:
            seen = self.job(job_id)
            if seen.get("JobState") not in UNENDED_STATES or time.monotonic() > deadline:
                return seen
            time.sleep(0.2)

    def node_state(self) -> str:
        proc = self.command("sinfo", "-h", "-n", NODE, "-o", "%T")
        return proc.stdout.strip().upper()

    def node(self) -> dict[str, str]:
        """slurmctld's record of the node (`scontrol -o show node`) as Key -> value; Reason, which
        may hold blanks, whole."""
        line = self.scontrol("-o", "show", "node", NODE).stdout.strip()
        before, _, reason = line.partition(" Reason=")
        found = dict(word.split("=", 1) for word in before.split() if "=" in word)
        if reason:
            found["Reason"] = reason
        return found

    def heal(self) -> str | None:
        """Put the node back in service when it is drained, down or failing (a state no test set:
        each test that sets one restores it); what was found, with Slurm's reason, or None when
        the node was in service."""
        seen = self.node()
        state = seen.get("State", "")
        if not {"DRAIN", "DOWN", "FAIL"} & set(state.replace("+", " ").replace("*", "").split()):
            return None
        self.resume()
        return f"node {NODE} was {state} ({seen.get('Reason', 'no reason given')}): resumed"

    def drain(self, reason: str = "kdtree test drain") -> None:
        """Drain the node: new jobs wait (PD, ReqNodeNotAvail / Resources) until resume()."""
        self.scontrol("update", f"NodeName={NODE}", "State=DRAIN", f"Reason={reason}")

    def resume(self) -> None:
        self.scontrol("update", f"NodeName={NODE}", "State=RESUME")
        self._wait(lambda: self.node_state() in ("IDLE", "MIXED", "ALLOCATED"), f"node {NODE} back")

    def ctld_log(self) -> str:
        path = self.dir / "log" / "slurmctld.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self) -> str:
        """The tails of every daemon's log (for a failure's message)."""
        parts = []
        for path in sorted((self.dir / "log").glob("*")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-1500:]}")
        return "\n".join(parts)
