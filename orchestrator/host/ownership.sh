# shellcheck shell=bash
# The ownership check (orchestrator/ownership.py states the rule), prepended to every script that
# works under remote_dir. kd_owned DIR [new]: refuse (prints UNSAFE ..., exits 86) unless DIR and the
# way to it pass the rule; `new`: DIR need not exist yet (the lock creates it, then checks again).

KD_PGID=
kd_unsafe() { printf 'UNSAFE %s\n' "$*"; exit 86; }
kd_private_gid() {   # U's primary gid if it is U's private group, else a gid no file has (asked once, lazily)
  [ -n "$KD_PGID" ] && return
  local g members
  g=$(id -g); members=$(getent group "$g" | cut -d: -f4)
  if { [ -z "$members" ] || [ "$members" = "$(id -un)" ]; } && \
     [ -z "$(getent passwd | awk -F: -v g="$g" -v u="$EUID" '$4 == g && $3 != u' | head -n1)" ]; then
    KD_PGID=$g; else KD_PGID=4294967294; fi
}
kd_owned() {
  local d=$1 uid=$EUID real p owner group mode name found
  local -a parents=()
  case $d in /*) ;; *) kd_unsafe "$d is not an absolute path";; esac
  [ -L "$d" ] && kd_unsafe "$d is a symlink"
  # an existing DIR resolved by bash itself (a subshell, no program to start: this check runs before
  # every command under remote_dir); one still to be made (`new`) by realpath
  if ! { [ -d "$d" ] && real=$(cd -P -- "$d" 2>/dev/null && pwd); }; then
    real=$(realpath -m -- "$d") || kd_unsafe "cannot resolve $d"
  fi
  [ "$real" = "$d" ] || kd_unsafe "$d resolves to $real (a symlink on the way)"
  [ "$real" = "$(cd ~ 2>/dev/null && pwd -P)" ] && kd_unsafe "$d is the home directory"
  [ -e "$d" ] && [ ! -d "$d" ] && kd_unsafe "$d exists and is not a directory"
  p=$d
  while [ "$p" != / ]; do p=${p%/*}; p=${p:-/}; [ -e "$p" ] && parents+=("$p"); done
  while read -r owner group mode name; do
    mode=$((8#$mode))
    if [ "$owner" != 0 ] && [ "$owner" != "$uid" ]; then
      kd_unsafe "$name (a parent of remote_dir) is owned by uid $owner, not by root or this user (uid $uid): that user could swap remote_dir"
    fi
    [ "$owner" = 0 ] && (( mode & 8#1000 )) && continue    # root's sticky /tmp: whoever may write there, nobody swaps U's entries
    if (( mode & 8#020 )); then kd_private_gid; [ "$group" = "$KD_PGID" ] && mode=$(( mode & ~8#020 )); fi
    if (( mode & 8#022 )); then
      kd_unsafe "$name (a parent of remote_dir) is writable by group or others (mode $(printf %o "$mode")) and not a root-owned sticky directory: they could swap remote_dir"
    fi
  done < <(stat -c '%u %g %a %n' -- "${parents[@]}")
  if [ ! -e "$d" ]; then [ "$2" = new ] && return 0; kd_unsafe "$d does not exist"; fi
  [ -L "$d/.kdtree" ] && kd_unsafe "$d/.kdtree is a symlink"
  [ -L "$d/build" ] && kd_unsafe "$d/build is a symlink"
  found=$(find "$d" \( ! -uid "$uid" -o ! -type l -perm /022 \) -printf '%U %G %m %p\n' -quit 2>/dev/null)
  [ -n "$found" ] && kd_private_gid
  if [ -n "$found" ] && [ "$KD_PGID" != 4294967294 ]; then    # group write by the user's private group: look again
    found=$(find "$d" \( ! -uid "$uid" -o ! -type l \( -perm /002 -o -perm /020 ! -gid "$KD_PGID" \) \) \
      -printf '%U %G %m %p\n' -quit 2>/dev/null)
  fi
  if [ -n "$found" ]; then
    read -r owner group mode name <<< "$found"
    [ "$owner" != "$uid" ] && kd_unsafe "$name is owned by uid $owner, not by this user (uid $uid): remote_dir and everything in it must be"
    kd_unsafe "$name is writable by group or others (mode $mode): nothing under remote_dir may be"
  fi
  if [ -d "$d/.kdtree" ]; then
    found=$(find "$d/.kdtree" -mindepth 1 -type l -printf '%p\n' -quit 2>/dev/null)
    [ -n "$found" ] && kd_unsafe "$found is a symlink: the orchestrator's state is never read or written through one"
  fi
  return 0
}
