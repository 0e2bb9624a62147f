#!/usr/bin/env python3
"""Paramiko (the orchestrator's SshTransport) against OpenSSH with ControlMaster, side by side.

    python3 benchmarks/transport_compare.py [--repeats 9] [--hosts 8] [--mib 64] [--json out.json]

A script, not a test. It starts --hosts OpenSSH sshd processes on 127.0.0.1 (tests/sshd.py: own
port and host key each, the lab's ssh config and known_hosts; nothing of ~/.ssh) and measures,
as medians of --repeats runs, with the client's CPU time (user + system, this process and its
children) beside the wall time:

  cold      a new connection, one `true`, closed: SshTransport (host key verified against the
            known_hosts files, keepalive watchdog) / `ssh -o ControlMaster=no` (BatchMode,
            StrictHostKeyChecking=yes, the same known_hosts), with OpenSSH's default key exchange
            (post-quantum sntrup761x25519) and (cold-x25519) with Paramiko's, curve25519
  warm      one more `true` over a connection already open: a Paramiko session channel / an
            `ssh` process multiplexed over a ControlMaster socket (ControlPersist)
  process   what one CLI invocation pays for a command when the connection must come from
            nowhere in a fresh process: `python3 -c` importing the transport, connecting,
            `true` / `ssh` over an already running ControlMaster (the warm-connection case);
            and the interpreter + import alone
  stream    --mib MiB through stdin to `cat > /dev/null`: Paramiko channel / ssh over the master
  fanout    a cold `true` on every host at once: --hosts threads of SshTransport in this process /
            --hosts `ssh` processes

It prints a table with the ratios openssh / paramiko and writes the figures as JSON (--json).
The CPU of `warm` and `stream` on the OpenSSH side is the mux client's only: the encryption runs
in the ControlMaster process, which is not a child of this one.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _load_sshd():
    spec = importlib.util.spec_from_file_location("kdtree_bench_sshd", REPO / "tests" / "sshd.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sshd = _load_sshd()


KEX = "curve25519-sha256"           # the key exchange Paramiko negotiates with OpenSSH


def cpu() -> float:
    """CPU seconds (user + system) of this process and its waited-for children."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def measure(fn, repeats: int) -> dict:
    """Median wall and CPU seconds of `repeats` calls of fn (one warm-up call first)."""
    fn()
    walls, cpus = [], []
    for _ in range(repeats):
        c0, t0 = cpu(), time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(cpu() - c0)
    return {"wall": statistics.median(walls), "cpu": statistics.median(cpus)}


class OpenSsh:
    """System ssh to the lab's hosts with the orchestrator's security options, and a
    ControlMaster per host (a private socket directory, ControlPersist)."""

    def __init__(self, lab, work: Path):
        self.lab = lab
        self.sockets = Path(tempfile.mkdtemp(prefix="cm-", dir=work))      # 0700
        self.base = ["ssh", "-F", str(lab.ssh_config), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                     "-o", f"UserKnownHostsFile={lab.known_hosts}"]

    def socket(self, host) -> str:
        return str(self.sockets / host.name)

    def cold(self, host, command: str = "true", kex: str | None = None) -> None:
        options = ["-o", f"KexAlgorithms={kex}"] if kex else []
        subprocess.run(self.base + options + ["-o", "ControlMaster=no", "-o", "ControlPath=none", host.name, command],
                       check=True)

    def start_master(self, host) -> None:
        subprocess.run(self.base + ["-o", "ControlMaster=yes", "-o", "ControlPersist=600", "-S", self.socket(host),
                                    "-N", "-f", host.name], check=True)

    def warm(self, host, command: str = "true", stdin=None) -> None:
        subprocess.run(self.base + ["-o", "ControlMaster=no", "-S", self.socket(host), host.name, command],
                       check=True, stdin=stdin)

    def stop_master(self, host) -> None:
        subprocess.run(self.base + ["-S", self.socket(host), "-O", "exit", host.name], capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="kdtree-transport-"))
    lab = sshd.SshLab(work / "lab")
    hosts = lab.add_hosts(args.hosts, "node")
    first = hosts[0]
    results: dict[str, dict] = {}
    try:
        with lab.environment():
            from orchestrator import inventory
            from orchestrator.connectors.paramiko import SshTransport
            entries = {h.name: lab.inventory_entry(h) for h in hosts}
            inv = inventory.parse({"project": {"source": str(REPO / "engine_src"), "excludes": [],
                                               "commands": {c: "true" for c in inventory.REQUIRED_COMMANDS},
                                               "results": {}},
                                   "hosts": entries}, work / "hosts.yaml")
            ssh = OpenSsh(lab, work)

            def paramiko_cold(host=first):
                with SshTransport(inv.hosts[host.name]) as t:
                    assert t.run("true", timeout=30).ok

            results["cold"] = {"paramiko": measure(paramiko_cold, args.repeats),
                               "openssh": measure(lambda: ssh.cold(first), args.repeats)}
            # OpenSSH's default key exchange is post-quantum (sntrup761x25519); Paramiko's is curve25519
            results["cold-x25519"] = {"paramiko": results["cold"]["paramiko"],
                                      "openssh": measure(lambda: ssh.cold(first, kex=KEX), args.repeats)}

            open_transport = SshTransport(inv.hosts[first.name])
            open_transport.connect()
            ssh.start_master(first)
            results["warm"] = {"paramiko": measure(lambda: open_transport.run("true", timeout=30), args.repeats),
                               "openssh": measure(lambda: ssh.warm(first), args.repeats)}

            script = ("import sys; sys.path.insert(0, sys.argv[1]); from orchestrator import inventory; "
                      "from orchestrator.connectors.paramiko import SshTransport; "
                      "inv = inventory.load(sys.argv[2]); t = SshTransport(inv.hosts[sys.argv[3]]); "
                      "assert t.run('true', timeout=30).ok; t.close()")
            (work / "hosts.yaml").write_text(json.dumps({
                "project": {"source": str(REPO / "engine_src"), "excludes": [],
                            "commands": {c: "true" for c in inventory.REQUIRED_COMMANDS}, "results": {}},
                "hosts": entries}))
            env = {**os.environ, **lab.env()}
            results["process"] = {
                "paramiko": measure(lambda: subprocess.run([sys.executable, "-c", script, str(REPO), str(work / "hosts.yaml"),
                                                            first.name], check=True, env=env), args.repeats),
                "openssh": measure(lambda: ssh.warm(first), args.repeats),
                "python_import_only": measure(lambda: subprocess.run(
                    [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import orchestrator.connectors.factory, "
                     "paramiko", str(REPO)], check=True), args.repeats)}

            payload = work / "payload.bin"
            payload.write_bytes(os.urandom(args.mib << 20))

            def paramiko_stream():
                with open(payload, "rb") as f:
                    assert open_transport.run("cat > /dev/null", timeout=300, stdin=f).ok

            def openssh_stream():
                with open(payload, "rb") as f:
                    ssh.warm(first, "cat > /dev/null", stdin=f)

            stream_repeats = max(3, args.repeats // 3)
            results["stream"] = {"paramiko": measure(paramiko_stream, stream_repeats),
                                 "openssh": measure(openssh_stream, stream_repeats)}
            open_transport.close()
            ssh.stop_master(first)

            def fan(fn):
                with concurrent.futures.ThreadPoolExecutor(len(hosts)) as pool:
                    list(pool.map(fn, hosts))

            results["fanout"] = {"paramiko": measure(lambda: fan(paramiko_cold), args.repeats),
                                 "openssh": measure(lambda: fan(ssh.cold), args.repeats)}
    finally:
        lab.close()

    print(f"{platform.node()}: {os.cpu_count()} cores, {args.hosts} loopback sshd hosts, "
          f"{subprocess.run(['ssh', '-V'], capture_output=True, text=True).stderr.strip()}, "
          f"paramiko {__import__('paramiko').__version__}; medians of {args.repeats}")
    print(f"{'case':10} {'paramiko wall':>14} {'openssh wall':>13} {'ratio':>7} {'paramiko cpu':>13} {'openssh cpu':>12}")
    for case, r in results.items():
        p, o = r["paramiko"], r["openssh"]
        print(f"{case:10} {p['wall'] * 1000:11.1f} ms {o['wall'] * 1000:10.1f} ms {o['wall'] / p['wall']:7.2f} "
              f"{p['cpu'] * 1000:10.1f} ms {o['cpu'] * 1000:9.1f} ms")
    imp = results["process"]["python_import_only"]
    print(f"{'':10} python + import alone: {imp['wall'] * 1000:.1f} ms wall, {imp['cpu'] * 1000:.1f} ms cpu")
    print(f"stream: {args.mib} MiB; fanout: {args.hosts} hosts at once")
    if args.json:
        args.json.write_text(json.dumps({"hosts": args.hosts, "repeats": args.repeats, "mib": args.mib,
                                         "cores": os.cpu_count(), "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
