"""GPUs: nvidia-smi's CSV parsed as hostile input, the selection policy, the --gpus flag, the
inventory keys (pure; the host side is in test_gpu_claims.py)."""
from __future__ import annotations

import dataclasses
import types

import pytest
import yaml

from orchestrator import inventory
from orchestrator.resources import gpus
from orchestrator.errors import InventoryError, UsageError
from orchestrator.resources.gpus import Gpu, GpuProcess, GpuQueryError, GpuSelectionError, Request

from fake_gpus import FakeGpus

U = FakeGpus.uuid


def gpu_line(i, used=0, name="NVIDIA H200", util=0, total=143771, cap="9.0", bus=None):
    return f"{i}, {U(i)}, {name}, {used}, {total}, {util}, {cap}, {bus or f'00000000:{0x18 + i:02X}:00.0'}"


def output(gpu_lines, app_lines=(), rc_gpu=0, rc_app=0, smi="/usr/bin/nvidia-smi", err=()):
    lines = [f"smi {smi}"] + [f"gpu {l}" for l in gpu_lines] + [f"err-gpu {l}" for l in err] + [f"rc gpu {rc_gpu}"]
    lines += [f"app {l}" for l in app_lines] + [f"rc app {rc_app}"]
    return "\n".join(lines) + "\n"


def test_parses_gpus_and_their_processes():
    text = output([gpu_line(0), gpu_line(1, used=31000, util=97), gpu_line(2)],
                  [f"{U(1)}, 4242, /opt/sglang/bin/python3, 30000", f"{U(1)}, 77, nvidia-cuda-mps-server, 1000"])
    found = gpus.parse_query(text, host="g1")
    assert found.nvidia_smi == "/usr/bin/nvidia-smi"
    assert [g.index for g in found.gpus] == [0, 1, 2]
    g1 = found.gpus[1]
    assert (g1.uuid, g1.name, g1.memory_used_mib, g1.memory_total_mib, g1.utilization_pct, g1.compute_cap,
            g1.pci_bus_id) == (U(1), "NVIDIA H200", 31000, 143771, 97, "9.0", "00000000:19:00.0")
    assert g1.processes == (GpuProcess(4242, "/opt/sglang/bin/python3", 30000), GpuProcess(77, "nvidia-cuda-mps-server", 1000))
    assert found.gpus[0].processes == ()
    assert g1.to_record(1024) == {
        "index": 1, "uuid": U(1), "name": "NVIDIA H200", "memory_used_mib": 31000, "memory_total_mib": 143771,
        "utilization_pct": 97, "compute_cap": "9.0", "pci_bus_id": "00000000:19:00.0",
        "processes": [{"pid": 4242, "name": "/opt/sglang/bin/python3", "used_mib": 30000},
                      {"pid": 77, "name": "nvidia-cuda-mps-server", "used_mib": 1000}], "busy": True}
    assert found.gpus[0].to_record(1024)["busy"] is False


def test_gpus_come_back_sorted_by_index():
    found = gpus.parse_query(output([gpu_line(2), gpu_line(0), gpu_line(1)]))
    assert [g.index for g in found.gpus] == [0, 1, 2]


def test_not_reported_values_are_none_and_commas_in_names_survive():
    text = output([f"0, {U(0)}, NVIDIA GeForce RTX 4090, Laptop, [N/A], 16376, [Not Supported], [N/A], [N/A]"],
                  [f"{U(0)}, [N/A], C:\\Program Files\\app, v2.exe, [N/A]"])
    g = gpus.parse_query(text).gpus[0]
    assert g.name == "NVIDIA GeForce RTX 4090, Laptop"
    assert (g.memory_used_mib, g.memory_total_mib, g.utilization_pct, g.compute_cap, g.pci_bus_id) == \
        (None, 16376, None, None, None)
    assert g.processes == (GpuProcess(None, "C:\\\\Program Files\\\\app, v2.exe", None),)
    assert g.why_busy(1024) == "1 compute process: pid ? C:\\\\Program Files\\\\app, v2.exe ? MiB"


def test_no_nvidia_smi_and_no_devices_mean_no_gpu():
    assert gpus.parse_query("smi -\n") == gpus.GpuInventory(None)
    found = gpus.parse_query(output(["No devices were found"], rc_gpu=6, rc_app=6))
    assert found == gpus.GpuInventory("/usr/bin/nvidia-smi", ())


def test_a_failing_nvidia_smi_is_an_error_with_its_exit_code_and_output():
    text = output(["NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."], rc_gpu=9,
                  err=["\x1b]52;c;cGF3bmVk\x07 clipboard"])
    with pytest.raises(GpuQueryError) as e:
        gpus.parse_query(text, host="g1")
    assert e.value.message == "/usr/bin/nvidia-smi --query-gpu=index,uuid,name,memory.used,memory.total," \
                              "utilization.gpu,compute_cap,pci.bus_id exited with 9"
    assert e.value.host == "g1" and e.value.exit_status == 9
    assert "couldn't communicate with the NVIDIA driver" in e.value.tail
    assert "\x1b" not in e.value.tail and "\\x1b]52;c;cGF3bmVk\\x07 clipboard" in e.value.tail


@pytest.mark.parametrize("lines, message", [
    (["0, GPU-x"], "nvidia-smi's GPU line 1 is not its CSV (2 fields, expected 8): 0, GPU-x"),
    ([gpu_line(0).replace("0, GPU", "zero, GPU", 1)],
     "nvidia-smi's GPU line 1 is not its CSV (index zero is not a number from 0 to 1023)"),
    ([gpu_line(0).replace(U(0), "GPU-../../etc")], "(uuid GPU-../../etc is not what nvidia-smi prints there)"),
    ([gpu_line(0).replace(U(0), "[N/A]")], "(uuid [N/A] is not what nvidia-smi prints there)"),
    ([gpu_line(0, used=-5)], "(memory.used -5 is not a number from 0 to 1073741824)"),
    ([gpu_line(0, used="1e99")], "(memory.used 1e99 is not a number from 0 to 1073741824)"),
    ([gpu_line(0, used=10 ** 30)], "is not a number from 0 to 1073741824"),
    ([gpu_line(0, util=101)], "(utilization.gpu 101 is not a number from 0 to 100)"),
    ([gpu_line(0, cap="9.0; rm -rf /")], "(compute_cap 9.0; rm -rf / is not what nvidia-smi prints there)"),
    ([gpu_line(0, bus="00000000:18:00.0\x1b[2J")], "pci.bus_id 00000000:18:00.0\\x1b[2J is not"),
    ([gpu_line(0), gpu_line(0)], "nvidia-smi's GPU line 2 is not its CSV (a GPU index or uuid listed twice)"),
    ([gpu_line(0), gpu_line(1).replace("1, GPU", "0, GPU", 1)], "GPU line 2 is not its CSV (a GPU index or uuid"),
    ([gpu_line(i) for i in range(gpus.MAX_GPUS)] + ["x"], "nvidia-smi listed 1025 GPUs (more than 1024)"),
])
def test_garbage_gpu_lines_are_a_clear_error(lines, message):
    with pytest.raises(GpuQueryError) as e:
        gpus.parse_query(output(lines), host="g1")
    assert message in e.value.message and e.value.host == "g1"
    assert "\x1b" not in e.value.message


@pytest.mark.parametrize("apps, message", [
    (["4242, python3, 30000"], "nvidia-smi's compute process line 1 is not its CSV (3 fields, expected 4)"),
    ([f"{U(0)}, -1, python3, 5"], "(pid -1 is not a number from 0 to 2147483648)"),
    ([f"{U(0)}, 12, python3, lots"], "(used_memory lots is not a number from 0 to 1073741824)"),
    ([f"{U(7)}, 12, python3, 5"], f"nvidia-smi lists a compute process (pid 12) on GPU {U(7)}, which its GPU "
                                  "query did not list"),
    ([f"{U(0)}, 1, p, 1"] * (gpus.MAX_PROCESSES + 1), "nvidia-smi listed 4097 compute processes (more than 4096)"),
])
def test_garbage_process_lines_are_a_clear_error(apps, message):
    with pytest.raises(GpuQueryError) as e:
        gpus.parse_query(output([gpu_line(0)], apps))
    assert message in e.value.message


@pytest.mark.parametrize("text, message", [
    ("smi /usr/bin/nvidia-smi\nrc gpu 0\n", "the GPU query ended before nvidia-smi answered both queries"),
    ("smi /usr/bin/nvidia-smi\nBOOM\n", "the GPU query printed an unexpected line 2: BOOM"),
    ("smi /usr/bin/nvidia-smi\nrc gpu x\n", "the GPU query printed an unexpected line 2: rc gpu x"),
])
def test_a_broken_query_answer_is_a_clear_error(text, message):
    with pytest.raises(GpuQueryError) as e:
        gpus.parse_query(text)
    assert e.value.message == message


def test_host_text_is_bounded_and_escaped():
    name = "A" * 500 + "\x1b[31m"
    process = "\x9b2J\u2028evil\\" + "p" * 500
    g = gpus.parse_query(output([gpu_line(0, name=name)], [f"{U(0)}, 5, {process}, 100"])).gpus[0]
    assert g.name == "A" * gpus.NAME_CHARS
    assert g.processes[0].name.startswith("\\x9b2J\\u2028evil\\\\p") and len(g.processes[0].name) < 110
    assert gpus.visible("tab\there\r\n\x00", 100) == "tab\\x09here\\x0d\\x0a\\x00"


# ---- selection --------------------------------------------------------------------------------

def fleet(n, busy=(), used=None):
    """n GPUs; `busy`: indices with a compute process; `used`: index -> MiB in use without one."""
    used = used or {}
    return tuple(Gpu(i, U(i), "NVIDIA H200", used.get(i, 30000 if i in busy else 3), 143771, 0, "9.0", None,
                     (GpuProcess(4000 + i, "sglang", 30000),) if i in busy else ()) for i in range(n))


def indices(gpu_list):
    return [g.index for g in gpu_list]


def test_idle_takes_the_first_idle_gpus():
    choice = gpus.choose(fleet(8, busy={0, 1, 3}), Request(count=2))
    assert choice.enough and indices(choice.taken()) == [2, 4]
    assert [(g.index, why) for g, why in choice.refused] == [
        (0, "1 compute process: pid 4000 sglang 30000 MiB"), (1, "1 compute process: pid 4001 sglang 30000 MiB"),
        (3, "1 compute process: pid 4003 sglang 30000 MiB")]


def test_idle_refuses_memory_over_the_threshold_and_unknown_memory():
    gpu_list = fleet(3, used={0: 1025, 1: 1024})
    gpu_list = gpu_list[:2] + (dataclasses.replace(gpu_list[2], memory_used_mib=None),)
    choice = gpus.choose(gpu_list, Request(count=None))
    assert indices(choice.taken()) == [1]
    assert [why for _, why in choice.refused] == ["1025 MiB in use (more than 1024 MiB)", "memory in use is not reported"]
    assert indices(gpus.choose(gpu_list, Request(count=None, max_used_mib=2048)).taken()) == [0, 1]


def test_not_enough_idle_names_each_busy_gpu_and_its_processes():
    gpu_list = fleet(3, busy={0, 2})
    gpu_list = gpu_list[:2] + (dataclasses.replace(gpu_list[2], processes=(
        GpuProcess(11, "python3", 20000), GpuProcess(12, "[Not Found]", None))),)
    choice = gpus.choose(gpu_list, Request(count=2))
    assert not choice.enough
    assert choice.shortage() == (
        "not enough GPUs: needs 2 idle GPUs (no compute process, at most 1024 MiB in use), 1 usable; "
        "GPU 0 (NVIDIA H200): 1 compute process: pid 4000 sglang 30000 MiB; "
        "GPU 2 (NVIDIA H200): 2 compute processes: pid 11 python3 20000 MiB, pid 12 [Not Found] ? MiB")
    assert gpus.choose(fleet(2, busy={0, 1}), Request()).shortage(waited=30) == (
        "not enough GPUs: needs 1 idle GPU (no compute process, at most 1024 MiB in use), none usable after "
        "waiting 30 s (gpu_wait); GPU 0 (NVIDIA H200): 1 compute process: pid 4000 sglang 30000 MiB; "
        "GPU 1 (NVIDIA H200): 1 compute process: pid 4001 sglang 30000 MiB")


def test_claimed_gpus_are_refused_with_their_holder():
    choice = gpus.choose(fleet(3), Request(count=2), claimed={U(0): "nightly by pid 7 on ci"})
    assert indices(choice.taken()) == [1, 2]
    assert choice.refused == ((fleet(3)[0], "claimed by another run (nightly by pid 7 on ci)"),)


def test_any_takes_busy_gpus_but_idle_ones_first():
    choice = gpus.choose(fleet(4, busy={0, 1}), Request("any", count=3))
    assert indices(choice.taken()) == [2, 3, 0] and choice.refused == ()
    assert indices(gpus.choose(fleet(2, busy={0, 1}), Request("any")).taken()) == [0]


def test_all_takes_every_gpu_the_policy_allows_and_at_least_one():
    assert indices(gpus.choose(fleet(8, busy={1, 5}), Request(count=None)).taken()) == [0, 2, 3, 4, 6, 7]
    assert indices(gpus.choose(fleet(3, busy={1}), Request("any", count=None)).taken()) == [0, 2, 1]
    none = gpus.choose(fleet(2, busy={0, 1}), Request(count=None))
    assert not none.enough and none.needed == 1


def test_an_explicit_list_takes_those_gpus_whatever_their_load():
    choice = gpus.choose(fleet(8, busy={3}), Request("list", (3, 0), count=None))
    assert indices(choice.taken()) == [3, 0]
    claimed = gpus.choose(fleet(8), Request("list", (3, 0), count=None), claimed={U(0): "validate by pid 9"})
    assert not claimed.enough and claimed.shortage().startswith("not enough GPUs: needs every GPU of the list 3, 0")
    assert indices(gpus.choose(fleet(8), Request("list", (5, 6, 7), count=2)).taken()) == [5, 6]
    with pytest.raises(GpuSelectionError) as e:
        gpus.choose(fleet(2), Request("list", (0, 3), count=None), host="g1")
    assert e.value.message == "GPU index 3 does not exist on the host (its GPUs: 0, 1)" and e.value.host == "g1"


def test_a_host_without_gpus_needs_none_unless_asked_explicitly():
    assert gpus.choose((), Request()).needed == 0
    assert gpus.choose((), Request()).enough
    with pytest.raises(GpuSelectionError) as e:
        gpus.choose((), Request(count=2, explicit=True))
    assert e.value.message == ("2 idle GPUs (no compute process, at most 1024 MiB in use) asked for, "
                               "but nvidia-smi lists no GPU")


# ---- the --gpus flag and the inventory keys ----------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    (None, None), ("2", gpus.Override(count=2)), ("all", gpus.Override()), (" all ", gpus.Override()),
    ("0,3", gpus.Override(indices=(0, 3))), ("3,", gpus.Override(indices=(3,))), ("7, 1", gpus.Override(indices=(7, 1))),
])
def test_gpus_flag(text, expected):
    assert gpus.parse_flag(text) == expected


@pytest.mark.parametrize("text, message", [
    ("0", "--gpus '0': not a count from 1 to 1024; give a count (2), all, or GPU indices (0,3; one index as 3,)"),
    ("two", "--gpus 'two': not a count from 1 to 1024"),
    ("-1", "--gpus '-1': not a count from 1 to 1024"),
    ("", "--gpus '': not a count from 1 to 1024"),
    (",", "--gpus ',': not a list of GPU indices from 0 to 1023"),
    ("0,,3", "--gpus '0,,3': not a list of GPU indices from 0 to 1023"),
    ("0,1024", "--gpus '0,1024': not a list of GPU indices from 0 to 1023"),
    ("1,$(id)", "--gpus '1,$(id)': not a list of GPU indices"),
    ("3,3", "--gpus '3,3': an index is given twice"),
])
def test_gpus_flag_errors(text, message):
    with pytest.raises(UsageError) as e:
        gpus.parse_flag(text)
    assert str(e.value).startswith(message) and e.value.exit_code == 2


def host(**keys):
    base = {"gpu_policy": "idle", "gpu_count": 1, "gpu_max_used_mib": 1024, "gpu_wait": 0}
    return types.SimpleNamespace(**{**base, **keys})


def test_request_from_the_inventory_with_the_flag_over_it():
    assert Request.for_host(host()) == Request("idle", (), 1, 1024, 0.0)
    assert Request.for_host(host(gpu_policy="any", gpu_count=2, gpu_max_used_mib=0, gpu_wait=60)) == \
        Request("any", (), 2, 0, 60.0)
    assert Request.for_host(host(gpu_policy=(4, 5), gpu_count=3)) == Request("list", (4, 5), None, explicit=True)
    assert Request.for_host(host(gpu_count=3), gpus.parse_flag("all")) == Request(count=None, explicit=True)
    assert Request.for_host(host(gpu_policy="any"), gpus.parse_flag("2")) == Request("any", count=2, explicit=True)
    assert Request.for_host(host(gpu_policy=(4, 5)), gpus.parse_flag("1")) == Request("list", (4, 5), 1, explicit=True)
    assert Request.for_host(host(gpu_wait=5), gpus.parse_flag("3,")) == \
        Request("list", (3,), None, wait=5.0, explicit=True)


SSH = {"address": "gpu1", "remote_dir": "/srv/kdtree"}


def test_inventory_gpu_keys_with_defaults(make_inventory):
    inv = make_inventory({"a": SSH, "b": {**SSH, "gpu_policy": [3, 0], "gpu_wait": 2.5},
                          "c": {**SSH, "gpu_policy": "any", "gpu_count": 8, "gpu_max_used_mib": 0}})
    a, b, c = inv.hosts["a"], inv.hosts["b"], inv.hosts["c"]
    assert (a.gpu_policy, a.gpu_count, a.gpu_max_used_mib, a.gpu_wait) == ("idle", 1, 1024, 0)
    assert (b.gpu_policy, b.gpu_wait) == ((3, 0), 2.5)
    assert (c.gpu_policy, c.gpu_count, c.gpu_max_used_mib) == ("any", 8, 0)


@pytest.mark.parametrize("keys, message", [
    ({"gpu_policy": "busy"}, "key 'gpu_policy': must be idle, any or a list of GPU indices (e.g. [0, 3]), not 'busy'"),
    ({"gpu_policy": "0,3"}, "key 'gpu_policy': must be idle, any or a list of GPU indices (e.g. [0, 3]), not '0,3'"),
    ({"gpu_policy": []}, "key 'gpu_policy': a list of GPU indices must name at least one GPU, each once"),
    ({"gpu_policy": [1, 1]}, "key 'gpu_policy': a list of GPU indices must name at least one GPU, each once"),
    ({"gpu_policy": [0, "1"]}, "key 'gpu_policy': must be an integer, not a string"),
    ({"gpu_policy": [1024]}, "key 'gpu_policy': must be between 0 and 1023, not 1024"),
    ({"gpu_count": 0}, "key 'gpu_count': must be between 1 and 1024, not 0"),
    ({"gpu_count": "all"}, "key 'gpu_count': must be an integer, not a string"),
    ({"gpu_max_used_mib": -1}, "key 'gpu_max_used_mib': must be between 0 and 1073741824, not -1"),
    ({"gpu_wait": -1}, "key 'gpu_wait': must be a number of seconds from 0 to 86400, not -1"),
    ({"gpu_wait": float("nan")}, "key 'gpu_wait': must be a number of seconds from 0 to 86400, not nan"),
    ({"gpu_wait": True}, "key 'gpu_wait': must be a number of seconds from 0 to 86400, not True"),
    ({"gpu_polcy": "any"}, "key 'gpu_polcy': unknown key (did you mean 'gpu_policy'?)"),
])
def test_inventory_gpu_key_errors(make_inventory, keys, message):
    with pytest.raises(InventoryError) as e:
        make_inventory({"h": {**SSH, **keys}})
    assert str(e.value).endswith(f"hosts.yaml: host 'h': {message}")


def test_inventory_gpu_keys_in_defaults(make_inventory, tmp_path):
    path = tmp_path / "hosts.yaml"
    make_inventory({"h": SSH})
    data = yaml.safe_load(path.read_text())
    data["defaults"].update({"gpu_policy": "any", "gpu_wait": 30})
    path.write_text(yaml.safe_dump(data))
    h = inventory.load(path).hosts["h"]
    assert (h.gpu_policy, h.gpu_wait) == ("any", 30)


# ---- views and co-tenants -----------------------------------------------------------------------

def test_table_rows_from_gpu_records():
    records = [g.to_record(1024) for g in fleet(3, busy={1})]
    records[2]["memory_used_mib"] = None
    records[2]["processes"] = [{"pid": i, "name": "w", "used_mib": None} for i in range(8)]
    rows = gpus.table_rows(records, selected=[0])
    assert rows[0] == ["0", "NVIDIA H200", "3 / 143771", "0 %", "idle", "-", "yes"]
    assert rows[1] == ["1", "NVIDIA H200", "30000 / 143771", "0 %", "busy", "4001 sglang 30000 MiB", ""]
    assert rows[2][2] == "? / 143771"
    assert rows[2][5] == "0 w ? MiB, 1 w ? MiB, 2 w ? MiB, 3 w ? MiB, 4 w ? MiB, 5 w ? MiB and 2 more"
    assert len(gpus.TABLE_HEADER) == len(rows[0])


def test_co_tenants_are_the_other_processes_seen_during_a_step():
    def sample(*procs):
        return gpus.GpuInventory("/usr/bin/nvidia-smi", (dataclasses.replace(fleet(2)[0], processes=procs),
                                                         dataclasses.replace(fleet(2)[1], processes=(
                                                             GpuProcess(9, "elsewhere", 5),))))
    engine = GpuProcess(500, "/srv/kdtree/build/kdtree", 900)
    samples = [sample(engine), sample(engine, GpuProcess(77, "python3", 2000)),
               sample(GpuProcess(77, "python3", 3000), GpuProcess(None, "[Not Found]", None))]
    assert gpus.co_tenants(samples, U(0), own={500}) == [
        {"pid": 77, "name": "python3", "max_used_mib": 3000, "samples": 2},
        {"pid": None, "name": "[Not Found]", "max_used_mib": None, "samples": 1}]
    assert gpus.co_tenants(samples[:1], U(0), own={500}) == []
    assert [p["pid"] for p in gpus.co_tenants(samples[:1], U(0), own=())] == [500]     # the name alone proves nothing


def test_the_query_command_as_data():
    command = gpus.query_command(types.SimpleNamespace(timeout=lambda step: 60),
                                 driver_paths=("/opt/x y", "/usr/bin")).line
    assert command.startswith("umask 077 && exec env -i ")
    assert command.endswith(" kdtree 262144 --query-gpu=index,uuid,name,memory.used,memory.total,utilization.gpu,"
                            "compute_cap,pci.bus_id --query-compute-apps=gpu_uuid,pid,process_name,used_memory "
                            "--format=csv,noheader,nounits '/opt/x y' /usr/bin")
    assert " kdtree-step 10 60 bash -c " in command
    assert gpus.DRIVER_PATHS[:3] == ("/usr/bin", "/usr/local/bin", "/usr/local/nvidia/bin")
    assert "/usr/lib/wsl/lib" in gpus.DRIVER_PATHS
