# shellcheck shell=bash
# kd_begin_sync OWNER RSYNC_PATH: the sync's first step, in .kdtree/ under the lock held alone (as
# the lock is taken, or when the holder is told to begin): report a sync that broke half-way
# (PARTIAL what its mark said, as one line of printable characters), mark this one, say where rsync
# is and its version line (RSYNC path, RSYNC_VERSION; none: the host has no rsync).
# OWNER: this run's owner, in words; RSYNC_PATH: the host's rsync_path (empty: rsync on PATH).
# Included in the lock script (state.py), after ownership.sh.

kd_begin_sync() {
  [ -e sync.partial ] && printf 'PARTIAL %s\n' "$(head -c 500 sync.partial | tr -c '[:print:]' ' ')"
  printf 'started %s\n' "$1" > sync.partial
  r=$2; [ -n "$r" ] || r=$(command -v rsync) || r=
  if [ -n "$r" ] && [ -x "$r" ]; then
    # never on this script's stdin (the lock's commands), and never for long: an rsync_path may be a wrapper
    printf 'RSYNC %s\nRSYNC_VERSION %s\n' "$r" \
      "$(timeout 10 "$r" --version </dev/null 2>/dev/null | head -n 1 | tr -c '[:print:]' ' ')"
  fi
  return 0
}
