# shellcheck shell=bash
# shellcheck disable=SC2015  # `A && B || C` here means "unless A and B, C" (C exits, continues or returns)
# The lock (state.py, built by host/client.py's lock): claim remote_dir (the ownership check, the
# marker, made private) and hold its lock until told. Sent after ownership.sh.
# $1 remote_dir, $2 the owner (JSON), $3 the marker's text, $4 shared|exclusive, $5 seconds to wait
# for the lock (0: none), $6 heartbeat silence (seconds, empty: none), $7 and on: scripts it runs
# when told, while the lock is held alone (the client's: the sync's first and last steps, which so
# take no session of their own).
# Answers LOCKED MODE (or HOLDER ... BUSY, exit 75; UNSAFE ..., exit 3 or 86), then reads commands
# on stdin: release, exclusive, shared, and `run I ARG...`: the I-th script of $7 and on, with $1
# and the ARGs as its arguments (each ARG an x and the value as `printf %b` decodes it); answers
# what it printed, then RAN and its exit status (RAN shared: not run, the lock is not held alone).

d=$1
unsafe() { printf 'UNSAFE %s\n' "$*"; exit 3; }
kd_owned "$d" new
# (only .kdtree in it: a run that is claiming it right now, between its mkdir and its marker)
# shellcheck disable=SC2010,SC2143  # only "anything besides .kdtree?": an odd name still makes a line
if [ -d "$d" ] && [ ! -f "$d/.kdtree/marker" ] && [ -n "$(ls -A -- "$d" | grep -vx .kdtree)" ]; then
  unsafe "$d is not empty and was not created by the orchestrator (no .kdtree/marker); empty it or choose another remote_dir"
fi
command -v flock >/dev/null || unsafe "flock (util-linux) is missing on the host"
claimed=; [ -d "$d/.kdtree" ] && claimed=1
[ -n "$claimed" ] || why=$(mkdir -p -- "$d/.kdtree" 2>&1) || unsafe "cannot create $d/.kdtree (${why//[^[:print:]]/ })"
# checked again when this made remote_dir or .kdtree; otherwise the check above saw all there is,
# and nobody else can have changed it since (the way to it and what is in it are not theirs)
[ -n "$claimed" ] || kd_owned "$d"
# remote_dir is this user's alone (0700, made so under the commands' umask): another user can open
# no lock or claim file in it (flock needs only a read handle), read no result and run no binary.
# A deploy of an earlier version (0755 folders, 0644 files) is made private here, once, whole.
if [ -n "$(find "$d" "$d/.kdtree" -maxdepth 0 -perm /077 -print -quit)" ]; then
  why=$(chmod -R go-rwx -- "$d" 2>&1) || unsafe "cannot make $d private (${why//[^[:print:]]/ })"
fi
[ -f "$d/.kdtree/marker" ] || printf '%s\n' "$3" > "$d/.kdtree/marker" || unsafe "cannot write $d/.kdtree/marker"
cd -- "$d/.kdtree" || unsafe "cannot enter $d/.kdtree"
mode=$4 wait=$5 silence=$6 me=holder-$$.json held=
scripts=("${@:7}")
exec 9>>lock.flock 7>>gate.flock
# take -s|-x: the tree lock (fd 9) in that mode, through the gate (fd 7), which a run holds while it
# waits to change the tree (or to go back to shared), so that no run overtakes it meanwhile. A
# failed change (shared -> exclusive drops the shared lock first) gets the shared lock back.
take() {
  local w=(-w "$wait"); [ "$wait" = 0 ] && w=(-n)
  flock "${w[@]}" 7 || return 1
  if ! flock "${w[@]}" "$1" 9; then [ -n "$held" ] && flock -s 9; flock -u 7; return 1; fi
  flock -u 7
}
# alive FILE: the holder file of a live run (it flocks its own file while it lives; `owner` is the
# single owner file of an earlier version's lock, which had no such flock).
alive() {
  local fd rc=0
  [ -f "$1" ] && [ ! -L "$1" ] && [ "$1" != "$me" ] || return 1
  [ "$1" = owner ] && return 0
  exec {fd}<"$1" || return 1
  flock -n "$fd" && rc=1
  exec {fd}<&-
  return "$rc"
}
# BUSY, after a HOLDER line with the owner of each live run holding the tree; a run that has just
# taken the lock writes its file a moment later: wait for it, briefly.
busy() {
  local f n=0 tries
  # shellcheck disable=SC2034  # ten tries: the counter itself is not read
  for tries in 1 2 3 4 5 6 7 8 9 10; do
    for f in holder-*.json owner; do
      alive "$f" && n=$((n + 1)) && printf 'HOLDER %s\n' "$(head -c 2000 -- "$f" | tr -d '\n')"
    done
    [ "$n" -gt 0 ] && break
    sleep 0.2
  done
  echo BUSY
}
take "$([ "$mode" = exclusive ] && echo -x || echo -s)" || { busy; exit 75; }
held=$mode
printf '%s\n' "$2" > "new-$me" && exec 8<"new-$me" && flock -n 8 && mv -f -- "new-$me" "$me" || unsafe "cannot write $d/.kdtree/$me"
# Holder files of runs that died (and an earlier version's owner file: we hold the lock now).
for f in holder-*.json owner; do
  [ -f "$f" ] && [ ! -L "$f" ] && [ "$f" != "$me" ] || continue
  if [ "$f" = owner ] || ! alive "$f"; then printf 'STALE %s\n' "$(head -c 2000 -- "$f" | tr -d '\n')"; rm -f -- "$f"; fi
done
# run I ARG...: in a subshell of its own (no bash to start: they run on every deploy's path), without
# the lock's descriptors or stdin (whatever the script does, it cannot let go of the lock, take it
# or read the client's next command); each value decoded by printf, never evaluated; its errors
# on its standard output, in order with the rest
run() {
  local words args=() w
  read -r -a words <<< "$1"
  [ "$held" = exclusive ] || { echo "RAN shared"; return; }
  [[ ${words[0]} =~ ^[1-9][0-9]*$ ]] && [ "${words[0]}" -le "${#scripts[@]}" ] || { echo "RAN 2"; return; }
  for w in "${words[@]:1}"; do printf -v w '%b' "${w#x}"; args+=("$w"); done
  (set -- "$d" "${args[@]}"; eval "${scripts[words[0] - 1]}") </dev/null 2>&1 7>&- 8>&- 9>&-
  echo "RAN $?"
}
echo "LOCKED $mode"
t=(); [ -n "$silence" ] && t=(-t "$silence")
while IFS= read -r "${t[@]}" reply; do
  case $reply in
    release) rm -f -- "$me"; exit 0;;
    exclusive) if [ "$held" = exclusive ] || take -x; then held=exclusive; echo EXCLUSIVE; else busy; fi;;
    shared) [ "$held" = exclusive ] && { flock 7; flock -s 9; flock -u 7; held=shared; }; echo SHARED;;
    run\ *) run "${reply#run }";;
  esac
done
exit 0
