# Sourced by the reference scripts (reproduce.sh, shared-gpu/reproduce.sh) from the repo root of a
# checkout that carries .debs/ and .whl/ (fetch-packages.sh): makes this GPU machine an ssh host of
# itself, the way a user reaches ct200. The machine has no sshd, ssh, rsync, fabric, invoke or
# paramiko and no network: the Debian packages are unpacked into a folder of ours ($R, never into
# /), sshd listens on 127.0.0.1 only, and the host is reached through an ssh-config alias (`h200`)
# whose host key is pinned with `invoke trust`. Leaves $repo, $lab, $R and $inv (the inventory) set.
repo=$(pwd)
R=/opt/kd-openssh
lab=/opt/kd-lab
mkdir -p "$R" "$lab"

host_path=$PATH          # the machine's own PATH, before ours: what its ssh sessions get
for deb in .debs/*.deb; do dpkg -x "$deb" "$R"; done
export LD_LIBRARY_PATH="$R/usr/lib/x86_64-linux-gnu:$R/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="$R/usr/bin:$R/usr/sbin:$PATH"
if ! python3 -c 'import fabric, invoke, paramiko' 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$lab/site" .whl/*.whl
fi
export PYTHONPATH="$lab/site:$repo"

# sshd on 127.0.0.1 with a fresh host key, key-only auth; its sessions get this machine's own PATH
# (where the image keeps nvidia-smi; not our unpacked rsync) and the unpacked libraries (for the
# rsync we point the inventory at), as a host's own profile would.
id sshd >/dev/null 2>&1 || useradd -r -d /run/sshd -s /usr/sbin/nologin sshd
mkdir -p /run/sshd
[ -f "$lab/host_key" ] || ssh-keygen -q -t ed25519 -N '' -f "$lab/host_key"
[ -f "$lab/client_key" ] || ssh-keygen -q -t ed25519 -N '' -f "$lab/client_key"
cp "$lab/client_key.pub" "$lab/authorized_keys"
port=2222
cat > "$lab/sshd_config" <<CFG
Port $port
ListenAddress 127.0.0.1
HostKey $lab/host_key
PidFile $lab/sshd.pid
AuthorizedKeysFile $lab/authorized_keys
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
PermitRootLogin prohibit-password
StrictModes no
Subsystem sftp $R/usr/lib/openssh/sftp-server
SetEnv LD_LIBRARY_PATH=$LD_LIBRARY_PATH PATH=$host_path
CFG
[ -f "$lab/sshd.pid" ] && kill "$(cat "$lab/sshd.pid")" 2>/dev/null || true
setsid "$R/usr/sbin/sshd" -f "$lab/sshd_config" -E "$lab/sshd.log"
sleep 1

# The client side: an ssh config naming the host by alias, as ~/.ssh/config names ct200.
cat > "$lab/ssh_config" <<CFG
Host h200
  HostName 127.0.0.1
  Port $port
  User root
  IdentityFile $lab/client_key
  IdentitiesOnly yes
CFG
export KDTREE_SSH_CONFIG="$lab/ssh_config" KDTREE_USER_KNOWN_HOSTS="$lab/user_known_hosts"
: > "$lab/known_hosts"; : > "$lab/user_known_hosts"

# The inventory: the shipped one plus the GPU host (its rsync lives where we unpacked it).
python3 - "$lab" "$R" "$repo" <<'PY'
import shutil, sys, yaml
lab, root, repo = sys.argv[1:4]
data = yaml.safe_load(open("hosts.yaml"))
data["project"]["source"] = f"{repo}/engine_src"
host = {"address": "h200", "user": "root", "remote_dir": "/opt/kdtree-engine", "cuda_home": "/usr/local/cuda",
        "python": shutil.which("python3"), "arch": "sm_90", "gpus": 1, "groups": ["hopper"],
        "known_hosts": f"{lab}/known_hosts"}
# h200: rsync where we unpacked it (rsync_path); h200-bare: the machine as it is, without rsync;
# h200-any: h200 with gpu_policy any (it shares the GPU with whoever uses it).
h200 = dict(host, rsync_path=f"{root}/usr/bin/rsync")
data["hosts"] = {"local": data["hosts"]["local"], "h200": h200,
                 "h200-bare": dict(host, remote_dir="/opt/kdtree-engine-bare"), "h200-any": dict(h200, gpu_policy="any")}
data["groups"] = {"hopper": {"description": "the H200 stand-in GPU host (sm_90)"}}
yaml.safe_dump(data, open(f"{lab}/hosts.yaml", "w"), sort_keys=False)
PY
inv="$lab/hosts.yaml"
fp=$(ssh-keygen -l -E sha256 -f "$lab/host_key.pub" | awk '{print $2}')
python3 -m invoke trust --inventory "$inv" --host h200 --fingerprint "$fp"
