# shellcheck shell=bash
# Arguments: a folder, an environment entry, pids; prints each pid of this user's processes whose
# executable lies under the folder or whose environment holds the entry (gpus.own_pids). (A deploying
# root can read every process's environment, and the entry is on the step's command line for all to see.)

under=${1%/}/ marker=$2 me=$(id -u); shift 2
for p; do
  [ "$(stat -c %u -- "/proc/$p" 2>/dev/null)" = "$me" ] || continue
  e=$(readlink -- "/proc/$p/exe" 2>/dev/null) || continue
  case $e in "$under"*) echo "$p"; continue ;; esac
  grep -qsxzF -- "$marker" "/proc/$p/environ" && echo "$p"
done
exit 0
