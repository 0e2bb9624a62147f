#!/usr/bin/env bash
# The fan-out section of bench_orchestrator.py on a 16-core machine without sshd, ssh or rsync
# (our GPU device), so that each of 16 loopback hosts has a core of its own, as a fleet has.
# Also the scale section: peak fds and memory of invoke at 64 and 256 hosts.
# From the repo root, with .debs/ and .whl/ (docs/gpu-reference/fetch-packages.sh):
#   bash benchmarks/fanout_16core.sh OUTDIR
set -uo pipefail
out=${1:?usage: fanout_16core.sh OUTDIR}
R=/opt/kd-openssh
mkdir -p "$R" "$out"
for deb in .debs/*.deb; do dpkg -x "$deb" "$R"; done
# The unpacked libraries for every process (sshd's sessions run rsync's far end), binaries on PATH.
cp -a "$R"/usr/lib/x86_64-linux-gnu/*.so* "$R"/lib/x86_64-linux-gnu/*.so* /usr/local/lib/ 2>/dev/null
ldconfig
export LD_LIBRARY_PATH="$R/usr/lib/x86_64-linux-gnu:$R/lib/x86_64-linux-gnu"
for b in ssh ssh-keygen rsync scp; do ln -sf "$R/usr/bin/$b" /usr/local/bin/$b; done
ln -sf "$R/usr/sbin/sshd" /usr/sbin/sshd        # tests/sshd.py starts /usr/sbin/sshd
id sshd >/dev/null 2>&1 || useradd -r -d /run/sshd -s /usr/sbin/nologin sshd
mkdir -p /run/sshd
python3 -c 'import invoke, paramiko' 2>/dev/null ||
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /opt/site .whl/*.whl
export PYTHONPATH=/opt/site
# invoke runs with its warm connections (persist: 600, the default) and --parallel's default
# (min(32, 4 x cores)); bare rsync is one process per host. The real engine tree (--files 0).
# Then the fds and memory at 64 and 256 hosts (one lab of 256 sshd). Each part writes its JSON as
# it ends: a part cut short by the device's time limit leaves the others' figures.
ulimit -n 65536 2>/dev/null || true
uptime | tee "$out/uptime-start.txt"
python3 benchmarks/bench_orchestrator.py --hosts "${FANOUT_HOSTS:-1,16,64}" --sections fanout \
  --repeats "${REPEATS:-3}" --no-ansible --files 0 --work-dir /opt/kd-bench-fanout --json "$out/fanout.json" \
  2>&1 | tee "$out/fanout.txt"
python3 benchmarks/bench_orchestrator.py --hosts "${SCALE_HOSTS:-64,256}" --sections scale --repeats 1 --no-ansible \
  --files 0 --work-dir /opt/kd-bench-scale --json "$out/scale.json" 2>&1 | tee "$out/scale.txt"
uptime | tee "$out/uptime-end.txt"
