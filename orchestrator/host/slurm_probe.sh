# shellcheck shell=bash
# The Slurm doctor probe (doctor.probe on a `scheduler: slurm` entry, run on its login node): $1 the
# entry's SLURM_CONF (empty: the login node's own), $2 its partition, then sbatch's options for its
# request (slurm.sbatch_options). Prints key=value lines: Slurm's version; the partition as
# scontrol shows it (one line) and scontrol's exit code; its nodes grouped by state, GRES, features
# and reason (sinfo); its jobs counted by state (squeue); sbatch --test-only's answer to the request
# and its exit code. Lines are cut at 4000 bytes, lists at 200 lines: the login node's Slurm is
# read as hostile (doctor.py checks every value).

conf=$1 partition=$2
shift 2
[ -n "$conf" ] && export SLURM_CONF=$conf
if ! command -v sinfo >/dev/null || ! command -v sbatch >/dev/null; then echo "slurm=missing"; exit 0; fi
bounded() { head -n 200 | cut -b 1-4000; }
echo "slurm_version=$(sinfo --version 2>&1 | head -n 1 | cut -b 1-200)"
p=$(scontrol -o show partition "$partition" 2>&1)
echo "partition_rc=$?"
printf '%s\n' "$p" | head -n 1 | cut -b 1-4000 | sed 's/^/partition=/'
sinfo -h -p "$partition" -o '%D|%T|%G|%f|%E' 2>&1 | bounded | sed 's/^/nodes=/'
if q=$(squeue -h -p "$partition" -o '%T' 2>&1); then
  printf '%s\n' "$q" | sort | uniq -c | head -n 50 | awk 'NF == 2 { print "queue=" $2 " " $1 }'
else
  printf '%s\n' "$q" | head -n 1 | cut -b 1-500 | sed 's/^/queue_error=/'
fi
t=$(sbatch --test-only "$@" --wrap true 2>&1)
echo "test_only_rc=$?"
printf '%s\n' "$t" | head -n 5 | cut -b 1-500 | sed 's/^/test_only=/'
exit 0
