"""orchestrator.connectors.hostkeys on its own (no sshd): fingerprints as ssh-keygen prints them, the
known_hosts names and files, pinning, the errors, and verify_policy on its own (a pinned host's
key is checked first by the connection's Transport, hostkeys.pinned_transport: tests/connectors/test_ssh.py)."""
from __future__ import annotations

import stat
import subprocess

import paramiko
import pytest

from orchestrator.connectors import hostkeys
from orchestrator.errors import HostKeyError


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("hostkey") / "key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return path


@pytest.fixture(scope="module")
def key(key_file):
    return paramiko.Ed25519Key(filename=str(key_file))


def test_fingerprint_is_ssh_keygens(key, key_file):
    out = subprocess.run(["ssh-keygen", "-l", "-E", "sha256", "-f", f"{key_file}.pub"], capture_output=True,
                         text=True, check=True).stdout
    assert hostkeys.fingerprint(key) == out.split()[1]


def test_known_names_carry_a_port_other_than_22():
    assert hostkeys.known_name("h.example", 22) == hostkeys.known_name("h.example", None) == "h.example"
    assert hostkeys.known_name("h.example", 23) == "[h.example]:23"


def test_the_user_known_hosts_file(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KDTREE_USER_KNOWN_HOSTS", raising=False)
    assert hostkeys.user_known_hosts() == tmp_path / ".ssh" / "known_hosts"
    assert hostkeys.known_hosts_files(None) == [tmp_path / ".ssh" / "known_hosts"]
    monkeypatch.setenv("KDTREE_USER_KNOWN_HOSTS", str(tmp_path / "mine"))
    assert hostkeys.known_hosts_files("project") == [hostkeys.Path("project"), tmp_path / "mine"]


def test_pin_creates_a_private_file_in_new_folders_and_appends(key, tmp_path):
    file = tmp_path / "a" / "b" / "known_hosts"
    hostkeys.pin(file, "[h]:2222", key)
    hostkeys.pin(file, "g", key)
    assert stat.S_IMODE(file.stat().st_mode) == 0o600
    assert file.read_text() == f"[h]:2222 ssh-ed25519 {key.get_base64()}\ng ssh-ed25519 {key.get_base64()}\n"


def test_the_errors_name_the_host_the_key_and_what_to_do(key):
    fp = hostkeys.fingerprint(key)
    e = hostkeys.unknown("web", "[a]:2", key, hop=False)
    assert (e.host, e.known_name, e.key, e.fingerprint, e.changed) == ("web", "[a]:2", key, fp, False)
    assert str(e).startswith(f"web: the host key of [a]:2 is not known: ssh-ed25519 {fp}. Nothing was run.")
    assert f"invoke trust --host web --fingerprint {fp}" in str(e)
    assert "the key of jump host [a]:2 is not known" in str(hostkeys.unknown("web", "[a]:2", key, hop=True))
    e = hostkeys.changed("web", "[a]:2", key, "SHA256:old", "the file F")
    assert (e.host, e.known_name, e.key, e.fingerprint, e.changed) == ("web", "[a]:2", key, fp, True)
    assert f"HOST KEY CHANGED for [a]:2: it offered ssh-ed25519 {fp} but the file F has SHA256:old." in str(e)
    assert "ssh-keygen -R '[a]:2' -f FILE" in str(e) and "invoke trust --host web" in str(e)


def test_verify_policy_on_its_own(key):
    fp = hostkeys.fingerprint(key)
    assert hostkeys.verify_policy("web", fp, hop=False).missing_host_key(None, "[a]:2", key) is None
    with pytest.raises(HostKeyError) as e:
        hostkeys.verify_policy("web", "SHA256:" + "B" * 43, hop=False).missing_host_key(None, "[a]:2", key)
    assert e.value.changed and (e.value.host, e.value.known_name) == ("web", "[a]:2")
    assert f"but host_key: in the inventory has SHA256:{'B' * 43}" in str(e.value)
    with pytest.raises(HostKeyError) as e:
        hostkeys.verify_policy("web", None, hop=True).missing_host_key(None, "[a]:2", key)
    assert not e.value.changed and "the key of jump host [a]:2 is not known" in str(e.value)
