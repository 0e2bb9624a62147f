"""What keeps the orchestrator fast, as unit tests (the figures are benchmarks/bench_orchestrator.py's):
no delayed-ACK wait per round trip, lazy imports, and the results cache of the test and bench steps."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator import connection, record, state, transport
from orchestrator.steps import StepContext, bench as bench_step, test as test_step
from orchestrator.sync import SourceId

REPO = Path(__file__).resolve().parent.parent


def test_paramiko_sockets_get_tcp_nodelay():
    with socket.socket() as s:
        connection._no_delay(s)
        assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    connection._no_delay(object())          # a jump host's channel or a ProxyCommand: left alone


def test_the_task_layer_imports_neither_paramiko_nor_jinja2():
    code = "import sys, tasks; print(sorted(m for m in ('paramiko', 'fabric', 'jinja2') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


TESTS = {"version": 1, "backend": "cpu", "passed": 2, "failed": 0, "skipped": 0,
         "tests": [{"name": "a", "status": "passed", "seconds": 0.1, "message": ""},
                   {"name": "b", "status": "passed", "seconds": 0.1, "message": ""}]}


@pytest.fixture
def context(make_inventory, tmp_path):
    """A step context on a local host whose deployment already holds test and bench results."""
    inv = make_inventory({"local": {"transport": "local", "remote_dir": str(tmp_path / "host")}})
    host = inv.hosts["local"]
    root = Path(host.remote_dir)
    (root / ".kdtree").mkdir(parents=True)
    (root / ".kdtree" / "deploy.json").write_text(json.dumps({"tree_hash": "t" * 64}))
    (root / "build").mkdir()
    (root / "build" / "test_results.json").write_text(json.dumps(TESTS))
    (root / "build" / "bench.json").write_text(json.dumps({"version": 1, "metrics": {}}))

    def make(command="validate", use_cache=True, keys=("build", "bundles")):
        run_dir = record.create_run_dir(tmp_path / "runs")
        ctx = StepContext(host, transport.open_transport(host), inv.project, run_dir, SourceId("t" * 64, None, False),
                          state.Owner.now(command), None, record.HostRecord(), use_cache, step="test",
                          log=lambda line: None)
        ctx.cache_keys.update({k: {"key": k} for k in keys})
        return ctx
    make.root = root
    return make


def test_results_key_needs_this_runs_build_and_bundle_keys(context):
    assert context().results_key() == {"tree": "t" * 64, "build": {"key": "build"}, "bundles": {"key": "bundles"}}
    assert context(use_cache=False).results_key() is None
    assert context(command="nightly").results_key() is None
    assert context(keys=("build",)).results_key() is None


def test_a_stamped_result_is_reused_until_inputs_or_the_file_change(context):
    ctx = context()
    assert ctx.cached_result("tests") is None                     # no stamp yet: the step runs
    ctx.stamp_result(TESTS)
    stamp = json.loads((context.root / ".kdtree" / "test.json").read_text())
    assert stamp["key"] == ctx.results_key() and len(stamp["digest"]) == 64
    assert stamp["run_id"] == ctx.run_dir.run_id
    assert context().cached_result("tests") == (TESTS, ctx.run_dir.run_id)      # and the run it came from
    other = context()
    other.cache_keys["build"] = {"key": "another compiler"}
    assert other.cached_result("tests") is None                   # inputs changed
    changed = dict(TESTS, passed=1)
    (context.root / "build" / "test_results.json").write_text(json.dumps(changed))
    assert context().cached_result("tests") is None               # not the file the stamp recorded
    assert context(command="nightly").cached_result("tests") is None


def test_cached_test_and_bench_steps(context):
    ctx = context()
    ctx.stamp_result(TESTS)
    outcome = test_step.run(context())
    assert outcome.status == "cached" and "2 passed" in outcome.message and outcome.reused_from == ctx.run_dir.run_id
    ctx.step = "bench"
    ctx.stamp_result({"version": 1, "metrics": {}})
    bench_ctx = context()
    bench_ctx.step = "bench"
    outcome = bench_step.run(bench_ctx)
    assert outcome.status == "cached" and outcome.reused_from == ctx.run_dir.run_id
    assert "not a new measurement" in outcome.message


def test_rsync_runs_over_the_relay_with_its_helper(make_inventory):
    from orchestrator import relay, sync
    from orchestrator.transport import SshTransport
    inv = make_inventory({"h": {"address": "h", "remote_dir": "/srv/kdtree", "rsync_path": "/opt/rsync dir/rsync"}})
    rsh = relay.remote.quote(relay.helper_argv("/tmp/kdtree-rsh-x/s"))
    argv = sync.rsync_argv(SshTransport(inv.hosts["h"]), inv.project, rsh=rsh)
    assert argv[argv.index("-e") + 1] == f"{sys.executable} -I -S {relay.HELPER} /tmp/kdtree-rsh-x/s"
    assert "--rsync-path='/opt/rsync dir/rsync'" in argv and argv[-1] == "h:/srv/kdtree/"
    assert relay.HELPER.is_file()


@pytest.mark.parametrize("command, rsync_path, ok", [
    ("rsync --server -slogDtprze.iLsfxCIvu", None, True),     # what rsync asks for (--protect-args)
    ("rsync --server -logDtprze.iLsfxCIvu --delete . /srv/kdtree/", None, True),
    ("'/opt/rsync dir/rsync' --server -slogDtprcze.iLsfxCIvu", "/opt/rsync dir/rsync", True),
    ("rsync --server -slogDtprcze.iLsfxCIvu", "/opt/rsync dir/rsync", False),
    ("rsync --server . /x; touch /tmp/canary", None, False),
    ("rsync --server . '$(touch /tmp/canary)'", None, False),
    ("rm -rf / --server ", None, False),
    ("rsync --daemon", None, False),
    ("/usr/bin/rsync --server . /x", None, False),
    ("rsync --server . /x\ntouch /tmp/canary", None, False),
])
def test_the_relay_runs_only_rsyncs_server(command, rsync_path, ok):
    from orchestrator import relay
    assert relay.allowed(command, rsync_path) is ok


def test_dry_run_shows_the_relay(make_inventory):
    from orchestrator import relay, state, sync
    from orchestrator.transport import LocalTransport, SshTransport
    inv = make_inventory({"h": {"address": "h", "remote_dir": "/srv/kdtree"},
                          "local": {"transport": "local", "remote_dir": "/work/.deploy/local"}})
    transfer = dict(sync.deploy_commands(SshTransport(inv.hosts["h"]), inv.project, state.Owner.now("deploy")))
    line = transfer["local: transfer (a tar stream instead when the host has no rsync)"]
    assert f"-e '{sys.executable} -I -S {relay.HELPER} " in line and "kdtree-rsh-XXXXXXXX/s'" in line
    assert relay.dry_run_shell(LocalTransport(inv.hosts["local"])) is None


def test_the_relay_never_reconnects_behind_the_lock(make_inventory):
    from orchestrator import relay
    from orchestrator.errors import ConnectError
    from orchestrator.transport import SshTransport
    inv = make_inventory({"h": {"address": "h", "remote_dir": "/srv/kdtree"}})
    with pytest.raises(ConnectError, match="lost before the transfer"):
        with relay.rsync_shell(SshTransport(inv.hosts["h"])):
            pass


def test_the_relay_socket_is_private_and_gone_once_rsync_connected(make_inventory):
    import os
    import stat
    import time
    from orchestrator import relay
    from orchestrator.transport import SshTransport
    inv = make_inventory({"h": {"address": "h", "remote_dir": "/srv/kdtree"}})
    r = relay._Relay(SshTransport(inv.hosts["h"]))
    try:
        assert stat.S_IMODE(os.stat(r.dir).st_mode) == 0o700 and stat.S_IMODE(os.stat(r.path).st_mode) == 0o600
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(r.path)
            deadline = time.monotonic() + 5
            while os.path.exists(r.dir) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not os.path.exists(r.dir)
    finally:
        r.close()
