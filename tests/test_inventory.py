"""Inventory: the shipped hosts.yaml, validation with exact messages, host selection."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator import inventory
from orchestrator.errors import InventoryError, UsageError
from orchestrator.slurm.entry import SlurmRequest

REPO = Path(__file__).resolve().parent.parent


def test_shipped_inventory():
    inv = inventory.load(REPO / "hosts.yaml")
    local, ct200 = inv.hosts["local"], inv.hosts["ct200"]
    assert local.transport == "local" and local.remote_dir == str(REPO / ".deploy" / "local")
    assert (ct200.transport, ct200.address, ct200.user) == ("ssh", "ct200", "root")
    assert (ct200.cuda_home, ct200.arch, ct200.gpus, ct200.groups) == ("/usr/local/cuda-13.0", "sm_120", 8, ("blackwell",))
    assert (ct200.python, ct200.remote_dir) == ("/root/venv_sglang211/bin/python", "/root/kdtree-engine")
    assert ct200.known_hosts == str(REPO / "known_hosts")
    assert ct200.timeout("build") == 900 and ct200.timeout("connect") == 10
    assert {"build/", ".git/", "tests/refs/model_*.kdtr"} <= set(inv.project.excludes)
    assert {"build", "bundles", "test", "generate", "bench"} <= set(inv.project.commands)
    assert inv.project.source == REPO / "engine_src"
    assert "src/" in inv.project.compiled and "tests/test_ops.cpp" in inv.project.compiled
    assert inv.project.documentation == ("README.md", "bench/experiments/")


def write(tmp_path, hosts, defaults=None, groups=None, project=None):
    data = yaml.safe_load((REPO / "hosts.yaml").read_text())
    data["project"]["source"] = str(tmp_path)
    data["project"].update(project or {})
    data["hosts"] = hosts
    data["defaults"] = defaults if defaults is not None else {}
    data["groups"] = groups or {}
    path = tmp_path / "hosts.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def error(tmp_path, hosts, **kw) -> str:
    with pytest.raises(InventoryError) as e:
        inventory.load(write(tmp_path, hosts, **kw))
    assert e.value.exit_code == 2
    return str(e.value).replace(str(tmp_path / "hosts.yaml"), "FILE")


SSH = {"address": "gpu1", "remote_dir": "/srv/kdtree"}


@pytest.mark.parametrize("entry, message", [
    ({**SSH, "adress": "x"}, "FILE: host 'h': key 'adress': unknown key (did you mean 'address'?)"),
    ({**SSH, "port": "22"}, "FILE: host 'h': key 'port': must be an integer, not a string"),
    ({**SSH, "port": 70000}, "FILE: host 'h': key 'port': must be between 1 and 65535, not 70000"),
    ({**SSH, "gpus": True}, "FILE: host 'h': key 'gpus': must be an integer, not a boolean"),
    ({**SSH, "groups": "a"}, "FILE: host 'h': key 'groups': must be a list, not a string"),
    ({**SSH, "transport": "winrm"}, "FILE: host 'h': key 'transport': must be one of ssh, local, not 'winrm'"),
    ({**SSH, "backend": "rocm"}, "FILE: host 'h': key 'backend': must be one of auto, cpu, cuda, not 'rocm'"),
    ({**SSH, "arch": "sm120"}, "FILE: host 'h': key 'arch': 'sm120' is not auto or sm_NN (e.g. sm_120)"),
    ({**SSH, "timeouts": {"biuld": 5}}, "FILE: host 'h': key 'timeouts.biuld': unknown key (did you mean 'build'?)"),
    ({**SSH, "timeouts": {"build": -1}}, "FILE: host 'h': key 'timeouts.build': must be a positive number of seconds, not -1"),
    ({"remote_dir": "/srv/kdtree"}, "FILE: host 'h': key 'address': is missing (an ssh-config alias or a hostname)"),
    ({"address": "gpu1"}, "FILE: host 'h': key 'remote_dir': is missing"),
    ({**SSH, "remote_dir": "kdtree"}, "FILE: host 'h': key 'remote_dir': 'kdtree' must be absolute on an ssh host"),
    ({**SSH, "remote_dir": "/"}, "FILE: host 'h': key 'remote_dir': '/' is a system directory; refusing to deploy there"),
    ({**SSH, "remote_dir": "/root"}, "FILE: host 'h': key 'remote_dir': '/root' is a system directory; refusing to deploy there"),
    ({**SSH, "remote_dir": "/home/bob"}, "FILE: host 'h': key 'remote_dir': '/home/bob' is a home directory; refusing to deploy there"),
    ({**SSH, "remote_dir": "/usr/local"}, "FILE: host 'h': key 'remote_dir': '/usr/local' is a system directory; refusing to deploy there"),
    ({**SSH, "remote_dir": "/data"}, "FILE: host 'h': key 'remote_dir': '/data' is too shallow (at least two levels, e.g. /srv/kdtree); refusing to deploy there"),
    ({**SSH, "remote_dir": "/srv/a/../b"}, "FILE: host 'h': key 'remote_dir': '/srv/a/../b' is not normalized (use '/srv/b'); refusing to deploy there"),
    ({**SSH, "remote_dir": "/srv/$(touch x)"}, "FILE: host 'h': key 'remote_dir': '/srv/$(touch x)' is not a safe path (letters, digits, space and ._/+,:@=- only)"),
    ({**SSH, "remote_dir": "/srv/a\nb"}, "FILE: host 'h': key 'remote_dir': must not contain a newline"),
    ({**SSH, "address": "gpu1;reboot"}, "FILE: host 'h': key 'address': 'gpu1;reboot' is not a hostname or ssh-config alias"),
    ({**SSH, "address": "-oProxyCommand=x"}, "FILE: host 'h': key 'address': must not start with '-'"),
    ({**SSH, "user": "ro`id`ot"}, "FILE: host 'h': key 'user': 'ro`id`ot' is not a user name"),
    ({**SSH, "jump": "bastion:22,evil host"}, "FILE: host 'h': key 'jump': 'evil host' is not [user@]host[:port]"),
    ({**SSH, "python": "python3 -c 'x'"}, "FILE: host 'h': key 'python': \"python3 -c 'x'\" is not a safe path (letters, digits, space and ._/+,:@=- only)"),
    ({**SSH, "cuda_home": "cuda"}, "FILE: host 'h': key 'cuda_home': 'cuda' must be an absolute path"),
    ({**SSH, "host_key": "abc"}, "FILE: host 'h': key 'host_key': 'abc' is not a SHA256 fingerprint (SHA256: and 43 base64 characters)"),
])
def test_host_validation_messages(tmp_path, entry, message):
    assert error(tmp_path, {"h": entry}) == message


def test_other_validation_messages(tmp_path):
    assert error(tmp_path, {"bad name": SSH}) == \
        "FILE: host 'bad name': a host name may use letters, digits, '_', '.', '-' and may not start with '-'"
    assert error(tmp_path, {"h": SSH}, defaults={"pyton": "x"}) == \
        "FILE: host 'defaults': key 'pyton': unknown key (did you mean 'python'?)"
    assert error(tmp_path, {"h": SSH}, project={"commands": {"build": "make"}}) == \
        "FILE: key 'project.commands.build_key': is missing"
    shipped = yaml.safe_load((REPO / "hosts.yaml").read_text())["project"]["commands"]
    assert error(tmp_path, {"h": SSH}, project={"commands": {k: v for k, v in shipped.items() if k != "version"}}) == \
        "FILE: key 'project.commands.version': is missing"     # the build step runs it
    assert error(tmp_path, {"h": SSH}, project={"compiled": "src/"}) == \
        "FILE: key 'project.compiled': must be a list, not a string"
    assert error(tmp_path, {"h": SSH}, project={"compiled": ["../src/"]}) == \
        "FILE: key 'project.compiled': '../src/' must be a path inside the source tree"
    assert error(tmp_path, {"h": SSH}, project={"documentation": {"README.md": 1}}) == \
        "FILE: key 'project.documentation': must be a list, not a mapping"
    assert error(tmp_path, {"h": SSH}, project={"documentation": ["/etc/notes"]}) == \
        "FILE: key 'project.documentation': '/etc/notes' must be a path inside the source tree"
    assert error(tmp_path, {"h": SSH}, groups={"g": {"descr": "x"}}) == \
        "FILE: key 'groups.g.descr': unknown key (did you mean 'description'?)"
    bad = tmp_path / "bad.yaml"
    bad.write_text("hosts: [")
    with pytest.raises(InventoryError, match=r"bad.yaml: not valid YAML"):
        inventory.load(bad)
    with pytest.raises(InventoryError, match=r"missing.yaml: cannot read: No such file or directory"):
        inventory.load(tmp_path / "missing.yaml")


@pytest.mark.parametrize("hosts, groups, message", [
    ({"h": {**SSH, "timeouts": {"build": 0}}}, {},
     "FILE: host 'h': key 'timeouts.build': must be a positive number of seconds, not 0"),
    ({"h": {**SSH, "timeouts": {"build": True}}}, {},
     "FILE: host 'h': key 'timeouts.build': must be a positive number of seconds, not True"),
    ({"h": {**SSH, "timeouts": {"build": 7 * 86400 + 1}}}, {},
     "FILE: host 'h': key 'timeouts.build': must be finite and at most 604800 seconds, not 604801"),
    ({"h": SSH}, {5: {}}, "FILE: key 'groups.5': is not a group name (letters, digits, '_', '.', '-', at most 64 "
                          "characters)"),
    ({"h": SSH}, {"a b": {}}, "FILE: key 'groups.a b': is not a group name (letters, digits, '_', '.', '-', at most "
                              "64 characters)"),
    ({"h": SSH}, {"g" * 65: {}}, f"FILE: key 'groups.{'g' * 64}': is not a group name (letters, digits, '_', '.', "
                                 "'-', at most 64 characters)"),
    ({"h": {**SSH, "groups": ["blackwel"]}}, {"blackwell": {}},
     "FILE: host 'h': key 'groups': group 'blackwel' is not declared under `groups:` (did you mean 'blackwell'?)"),
    ({"h": SSH}, {"g": "x"}, "FILE: key 'groups.g': must be a mapping, not a string"),
])
def test_timeout_and_group_messages(tmp_path, hosts, groups, message):
    assert error(tmp_path, hosts, groups=groups) == message


@pytest.mark.parametrize("value, message", [
    ("", "must not be empty"), (5, "must be a string, not an integer"), ("ro\rot", "must not contain a newline"),
    ("ro\0ot", "must not contain a newline"), ("r" * 1025, "must be at most 1024 characters, not 1025"),
])
def test_every_string_value_is_checked_with_a_message_naming_host_and_key(tmp_path, value, message):
    assert error(tmp_path, {"h": {**SSH, "user": value}}) == f"FILE: host 'h': key 'user': {message}"


@pytest.mark.parametrize("path, why", [
    ("", "is empty"), (" ", "is empty"), ("srv/kdtree", "is not absolute"), ("//srv/kdtree", "is not normalized "
                                                                                         "(use '//srv/kdtree')"),
    ("/srv/kdtree/", None), ("/srv/kdtreeX", None), ("/srv/kdtree", None),
])
def test_why_a_destination_is_dangerous(path, why):
    assert inventory.is_dangerous_dir(path) == why


def test_the_bounds_themselves_are_allowed(tmp_path):
    """Each limit is inclusive: a timeout of 7 days or half a second, port 65535, a group name of
    64 characters; a group keeps its name and description."""
    inv = inventory.load(write(tmp_path, {"h": {**SSH, "port": 65535, "timeouts": {"build": 7 * 86400, "test": 0.5},
                                                "python": "/" + "p" * 1023,
                                                "groups": ["g" * 64, "b"]}},
                               groups={"g" * 64: {"description": "long"}, "b": None}))
    h = inv.hosts["h"]
    assert (h.port, h.timeout("build"), h.timeout("test")) == (65535, 7 * 86400, 0.5)
    assert (inv.groups["g" * 64].name, inv.groups["g" * 64].description, inv.groups["g" * 64].members) == \
        ("g" * 64, "long", ("h",))
    assert inv.groups["b"].description == ""


def test_defaults_merge_and_local_paths(tmp_path):
    inv = inventory.load(write(tmp_path, {
        "local": {"transport": "local", "remote_dir": ".deploy/local"},
        "a": {**SSH, "timeouts": {"build": 5}, "groups": ["g"], "remote_dir": "/srv/with space"},
    }, defaults={"user": "eng", "timeouts": {"build": 7, "test": 8}, "identity": "keys/id"}, groups={"g": {}}))
    a = inv.hosts["a"]
    assert (a.user, a.timeout("build"), a.timeout("test"), a.timeout("bench")) == ("eng", 5, 8, 900)
    assert a.identity == str(tmp_path / "keys" / "id") and a.remote_dir == "/srv/with space"
    assert inv.hosts["local"].remote_dir == str(tmp_path / ".deploy" / "local")


def test_selection(tmp_path):
    inv = inventory.load(write(tmp_path, {
        "local": {"transport": "local", "remote_dir": ".deploy/local"},
        "ct200": {**SSH, "groups": ["blackwell"]}, "ct201": {**SSH, "groups": ["blackwell"]}},
        groups={"blackwell": {"description": "x"}}))
    names = lambda hosts: [h.name for h in hosts]
    assert names(inv.select()) == ["local"]
    assert names(inv.select(["ct201", "ct200", "ct201"])) == ["ct201", "ct200"]
    assert names(inv.select(group="blackwell")) == ["ct200", "ct201"]
    assert names(inv.select(all=True)) == ["local", "ct200", "ct201"]
    with pytest.raises(InventoryError) as e:
        inv.select(["ct2000"])
    assert str(e.value).endswith("hosts.yaml: unknown host 'ct2000' (did you mean 'ct200'?)")
    with pytest.raises(InventoryError) as e:
        inv.select(group="blackwel")
    assert str(e.value).endswith("hosts.yaml: unknown group 'blackwel' (did you mean 'blackwell'?)")
    assert names(inv.select(["local"], group="blackwell")) == ["local", "ct200", "ct201"]     # --host and --group


def test_a_selection_of_no_host_says_which_flag_and_how_to_fix_it(tmp_path):
    inv = inventory.load(write(tmp_path, {"h": SSH}, groups={"empty": {}}))
    with pytest.raises(UsageError) as e:
        inv.select(group="empty")
    assert str(e.value) == (f"--group empty: no host of {inv.path} is in group 'empty' "
                            "(a host joins it with `groups: [empty]`)")
    inv = inventory.load(write(tmp_path, {}))
    with pytest.raises(UsageError) as e:
        inv.select(all=True)
    assert str(e.value) == f"--all: {inv.path} has no hosts"


def test_cli_exit_code_2_on_unknown_host():
    proc = subprocess.run([sys.executable, "-m", "invoke", "deploy", "--host", "ct20"], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "unknown host 'ct20' (did you mean 'ct200'?)" in proc.stderr


def test_kdtree_orch_usage_errors_exit_2():
    for argv in (["deploy", "--nope"], ["trust"], ["deploy", "--host", "nope"]):
        proc = subprocess.run([sys.executable, "-c", "from orchestrator.program import main; main()", *argv],
                              cwd="/", capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert proc.returncode == 2, (argv, proc.stderr)


SLURM = {"scheduler": "slurm", "address": "login1", "remote_dir": "/shared/kdtree", "partition": "gpu", "gpus": 2}


def test_slurm_entry_is_parsed_into_its_request(tmp_path):
    inv = inventory.load(write(tmp_path, {
        "c": {**SLURM, "gpus": "h100:4", "account": "infer", "qos": "normal", "constraint": "sm_90&cuda12",
              "cpus_per_task": 16, "mem": "64G", "time_limit": "1-02:00:00", "queue_limit": 120,
              "slurm_conf": "/etc/slurm/gpu.conf"},
        "d": SLURM, "h": SSH}))
    c, d = inv.hosts["c"], inv.hosts["d"]
    assert c.slurm == SlurmRequest(partition="gpu", gres="gpu:h100:4", account="infer", qos="normal",
                                             constraint="sm_90&cuda12", cpus_per_task=16, mem="64G",
                                             time_limit=26 * 3600, queue_limit=120.0, conf="/etc/slurm/gpu.conf")
    assert (c.gpus, c.address, c.transport) == (4, "login1", "ssh")
    assert d.slurm == SlurmRequest(partition="gpu", gres="gpu:2") and d.gpus == 2
    assert d.slurm.queue_limit == 600 and d.slurm.time_limit is None
    assert inv.hosts["h"].slurm is None
    zero = inventory.load(write(tmp_path, {"c": {**SLURM, "gpus": 0}})).hosts["c"]
    assert zero.slurm is not None and zero.slurm.gres is None
    assert inventory.load(write(tmp_path, {"c": {**SLURM, "mem": 4096}})).hosts["c"].slurm.mem == "4096"


@pytest.mark.parametrize("entry, message", [
    ({**SLURM, "scheduler": "pbs"}, "FILE: host 'h': key 'scheduler': must be one of slurm, not 'pbs'"),
    ({**SLURM, "partiton": "gpu"}, "FILE: host 'h': key 'partiton': unknown key (did you mean 'partition'?)"),
    ({k: v for k, v in SLURM.items() if k != "partition"},
     "FILE: host 'h': key 'partition': is missing (the Slurm partition to run in)"),
    ({**SLURM, "partition": "gpu;id"}, "FILE: host 'h': key 'partition': 'gpu;id' is not a partition name"),
    ({**SLURM, "partition": "-p"}, "FILE: host 'h': key 'partition': must not start with '-'"),
    ({**SSH, "partition": "gpu"}, "FILE: host 'h': key 'partition': is only for a `scheduler: slurm` entry"),
    ({**SSH, "queue_limit": 5}, "FILE: host 'h': key 'queue_limit': is only for a `scheduler: slurm` entry"),
    ({**SLURM, "transport": "local"},
     "FILE: host 'h': key 'transport': a `scheduler: slurm` entry is reached over ssh (its login node)"),
    ({**SLURM, "gpu_policy": "any"}, "FILE: host 'h': key 'gpu_policy': is not for a `scheduler: slurm` entry: "
                                     "Slurm's allocation is the claim (`gpus:` is the GRES request)"),
    ({**SLURM, "gpus": "two"}, "FILE: host 'h': key 'gpus': 'two' is not a GPU count or TYPE:COUNT (e.g. 2 or h100:2)"),
    ({**SLURM, "gpus": "h100:x"},
     "FILE: host 'h': key 'gpus': 'h100:x' is not TYPE:COUNT with a count from 1 to 1024 (e.g. h100:2)"),
    ({**SLURM, "gpus": "h 100:2"},
     "FILE: host 'h': key 'gpus': 'h 100' is not TYPE:COUNT with a GRES type name (e.g. h100:2)"),
    ({**SLURM, "gpus": -1}, "FILE: host 'h': key 'gpus': must be between 0 and 1024, not -1"),
    ({**SLURM, "account": "a b"}, "FILE: host 'h': key 'account': 'a b' is not a Slurm account name"),
    ({**SLURM, "qos": ["x"]}, "FILE: host 'h': key 'qos': must be a string, not a list"),
    ({**SLURM, "constraint": "sm_90 && $(id)"},
     "FILE: host 'h': key 'constraint': 'sm_90 && $(id)' is not a Slurm constraint (features and & | [ ] ( ) *)"),
    ({**SLURM, "cpus_per_task": 0}, "FILE: host 'h': key 'cpus_per_task': must be between 1 and 4096, not 0"),
    ({**SLURM, "cpus_per_task": "8"}, "FILE: host 'h': key 'cpus_per_task': must be an integer, not a string"),
    ({**SLURM, "mem": "64GB"}, "FILE: host 'h': key 'mem': '64GB' is not memory for sbatch --mem: MiB, or a count "
                               "with K, M, G or T (e.g. 64G)"),
    ({**SLURM, "mem": "0"}, "FILE: host 'h': key 'mem': '0' is not memory for sbatch --mem: MiB, or a count "
                            "with K, M, G or T (e.g. 64G)"),
    ({**SSH, "mem": "4G"}, "FILE: host 'h': key 'mem': is only for a `scheduler: slurm` entry"),
    ({**SLURM, "time_limit": "2:61:00"}, "FILE: host 'h': key 'time_limit': '2:61:00' is not seconds or [D-]HH:MM:SS"),
    ({**SLURM, "time_limit": 30}, "FILE: host 'h': key 'time_limit': must be between 60 and 604800, not 30"),
    ({**SLURM, "queue_limit": 0},
     "FILE: host 'h': key 'queue_limit': must be a number of seconds above 0 and at most 604800, not 0"),
    ({**SLURM, "queue_limit": True},
     "FILE: host 'h': key 'queue_limit': must be a number of seconds above 0 and at most 604800, not True"),
    ({**SLURM, "slurm_conf": "slurm.conf"},
     "FILE: host 'h': key 'slurm_conf': 'slurm.conf' must be an absolute path on the login node"),
])
def test_slurm_entry_validation_messages(tmp_path, entry, message):
    assert error(tmp_path, {"h": entry}) == message


def test_slurm_keys_are_not_defaults(tmp_path):
    assert error(tmp_path, {"h": SSH}, defaults={"partition": "gpu"}) == \
        "FILE: host 'defaults': key 'partition': is a key of a `scheduler: slurm` host entry, not of defaults"
