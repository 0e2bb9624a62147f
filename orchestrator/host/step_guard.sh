# shellcheck shell=bash
# shellcheck disable=SC2013  # the words looped over are /proc/PID/environ and stat paths: no space in them
# remote.GUARD: $1 KILL_AFTER, $2 TIMEOUT, then the argv. The step gets /dev/null as stdin; a
# background watcher reads our stdin (fd 3) and stops the step's process group when it ends (or the
# step's process, if it has not made its group yet); what the step left in its group, or in another
# group of its session (a job-control shell's jobs), is killed at the end. Every process of the step
# carries a tag in its environment (KDTREE_STEP=<guard pid>.<random>):
# at the end, those that left the group (setsid, daemons) are found by it in /proc and killed too.
# A TERM, HUP or INT sent to the guard is passed on to the step's group (timeout then KILLs it after
# $1 seconds): whoever stops the guard stops the step, which is in a session of its own. Slurm's
# kill of a job step (TERM, then KILL after KillWait) reaches the guard's process group only: without
# this the step outlived it, holding the step's output open until slurmd gave up ("Kill task
# failed") and drained the node.
exec 3<&0 0</dev/null
tag=KDTREE_STEP=$$.$RANDOM$RANDOM$RANDOM
env "$tag" setsid -w timeout -k "$1" "$2" "${@:3}" 3<&- &
step=$!
{ read -r _ <&3; kill -TERM -- "-$step" || kill -TERM "$step"; } >/dev/null 2>&1 &
guard=$!
exec 3<&-
trap 'kill -TERM -- "-$step" 2>/dev/null || kill -TERM "$step" 2>/dev/null' TERM HUP INT
wait "$step"
rc=$?
# a trapped signal ends `wait` early: wait again until the step has ended
while kill -0 "$step" 2>/dev/null; do wait "$step"; rc=$?; done
kill "$guard" 2>/dev/null
kill -KILL -- "-$step" 2>/dev/null
# what is left of it, in one pass of one grep over /proc: any process of its session (its other
# groups: a job-control shell's jobs), by field 6 of /proc/PID/stat after the name's last ") "
# (a name may hold one), and any process with its tag, which left the session (setsid, daemons)
for f in $(grep -lsxzE -e "${tag//./\\.}" -e "[0-9]+ \(.*\) [A-Za-z] -?[0-9]+ -?[0-9]+ $step [^)]*" \
             /proc/[0-9]*/environ /proc/[0-9]*/stat); do
  f=${f#/proc/}; kill -KILL "${f%/*}"
done 2>/dev/null
exit "$rc"
