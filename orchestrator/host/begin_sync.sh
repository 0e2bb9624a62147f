# shellcheck shell=bash
# The sync's first step (sync.py, through state.HostLock.begin_sync), in .kdtree/ under the tree
# lock the client holds alone: the lock command (host/lock.sh, which checked ownership as it
# claimed remote_dir) carries it and runs it when told (host/client.py's begin_sync_request).
# $1 remote_dir, $2 this run's owner in words, $3 the host's rsync_path (empty: rsync on PATH),
# $4 `known` when the client knows where rsync is already (this run's doctor probe said it).
# Reports a sync that broke half-way (PARTIAL what its mark said, as one line of printable
# characters), marks this one, says where rsync is and its version line unless known (RSYNC path,
# RSYNC_VERSION; none: the host has no rsync).

cd -- "$1/.kdtree" || exit 3
[ -e sync.partial ] && printf 'PARTIAL %s\n' "$(head -c 500 sync.partial | tr -c '[:print:]' ' ')"
printf 'started %s\n' "$2" > sync.partial || exit 3
[ "$4" = known ] && exit 0
r=$3; [ -n "$r" ] || r=$(command -v rsync) || r=
if [ -n "$r" ] && [ -x "$r" ]; then
  # never for long: an rsync_path may be a wrapper
  v=$(timeout 10 "$r" --version </dev/null 2>/dev/null | head -n 1)
  printf 'RSYNC %s\nRSYNC_VERSION %s\n' "$r" "${v//[^[:print:]]/ }"
fi
exit 0
