# shellcheck shell=bash
# $1 remote_dir: delete the NUL-terminated paths read on stdin (relative, never out of remote_dir
# or into .kdtree/), for the tar sync.

cd -- "$1" || exit 3
while IFS= read -r -d '' p; do
  case $p in /*|..|../*|*/../*|*/..|.kdtree|.kdtree/*) continue;; esac
  if [ -d "$p" ] && [ ! -L "$p" ]; then rm -rf -- "$p"; else rm -f -- "$p"; fi
done
