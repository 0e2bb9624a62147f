# shellcheck shell=bash
# shellcheck disable=SC2015  # `A && B || C` here means "unless A and B, C" (C exits)
# GPU claims (gpu_claims.py), sent after ownership.sh.
# $1 remote_dir, $2 the owner (JSON), $3 how many GPUs to claim (0: only report who holds which),
# $4 heartbeat silence (seconds or empty), then the candidate GPUs' uuids in preference order.
# Every candidate is tried: the first $3 free ones are kept, the others only tested (to name who
# holds them). Answers STALE/HELD lines, then CLAIMED UUIDS (and holds them until `release` on
# stdin), SHORT (exit 75) or PROBED.

d=$1 owner=$2 count=$3 silence=$4; shift 4
unsafe() { printf 'UNSAFE %s\n' "$*"; exit 3; }
kd_owned "$d" new     # the same rule as the lock: remote_dir and the way to it are ours alone
[ "$count" = 0 ] && [ ! -e "$d/.kdtree" ] && { echo PROBED; exit 0; }    # nothing ever claimed there
[ -d "$d/.kdtree" ] && [ ! -L "$d/.kdtree" ] || unsafe "$d/.kdtree is not the orchestrator's state directory"
cd -- "$d/.kdtree" || unsafe "cannot enter $d/.kdtree"
command -v flock >/dev/null || unsafe "flock (util-linux) is missing on the host"
taken=()
for u in "$@"; do
  case $u in GPU-*) ;; *) unsafe "not a GPU uuid: $u";; esac
  for f in "gpu-$u.flock" "gpu-$u.owner"; do [ -L "$f" ] && unsafe "$d/.kdtree/$f is a symlink"; done
  exec {fd}>>"gpu-$u.flock" || unsafe "cannot open $d/.kdtree/gpu-$u.flock"
  if flock -n "$fd"; then
    if [ "${#taken[@]}" -lt "$count" ]; then
      taken+=("$u")
      [ -s "gpu-$u.owner" ] && printf 'STALE %s %s\n' "$u" "$(head -c 2000 "gpu-$u.owner" | tr -d '\n')"
      continue
    fi
  else
    printf 'HELD %s %s\n' "$u" "$(head -c 2000 "gpu-$u.owner" 2>/dev/null | tr -d '\n')"
  fi
  exec {fd}>&-
done
[ "$count" = 0 ] && { echo PROBED; exit 0; }
[ "${#taken[@]}" -ge "$count" ] || { echo SHORT; exit 75; }
for u in "${taken[@]}"; do printf '%s\n' "$owner" > "gpu-$u.owner"; done
echo "CLAIMED ${taken[*]}"
wait=(); [ -n "$silence" ] && wait=(-t "$silence")
while IFS= read -r "${wait[@]}" reply; do
  [ "$reply" = release ] && { for u in "${taken[@]}"; do rm -f -- "gpu-$u.owner"; done; exit 0; }
done
exit 0
