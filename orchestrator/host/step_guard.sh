# shellcheck shell=bash
# shellcheck disable=SC2013  # the words looped over are /proc/PID/environ paths: no space in them
# remote.GUARD: $1 KILL_AFTER, $2 TIMEOUT, then the argv. The step gets /dev/null as stdin; a
# background watcher reads our stdin (fd 3) and stops the step's process group when it ends (or the
# step's process, if it has not made its group yet); what the step left in its group is killed at the
# end. Every process of the step carries a tag in its environment (KDTREE_STEP=<guard pid>.<random>):
# at the end, those that left the group (setsid, daemons) are found by it in /proc and killed too.
exec 3<&0 0</dev/null
tag=KDTREE_STEP=$$.$RANDOM$RANDOM$RANDOM
env "$tag" setsid -w timeout -k "$1" "$2" "${@:3}" 3<&- &
step=$!
{ read -r _ <&3; kill -TERM -- "-$step" || kill -TERM "$step"; } >/dev/null 2>&1 &
guard=$!
exec 3<&-
wait "$step"
rc=$?
kill "$guard" 2>/dev/null
kill -KILL -- "-$step" 2>/dev/null
for f in $(grep -lsxzF -- "$tag" /proc/[0-9]*/environ); do f=${f#/proc/}; kill -KILL "${f%/environ}"; done 2>/dev/null
exit "$rc"
