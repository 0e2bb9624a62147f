# shellcheck shell=bash
# Arguments: remote_dir, the bundle folder, then files relative to the folder: each removed only
# when it is a regular file (not a link) whose real path lies inside the folder.

d=$1 f=$2; shift 2
inner=$(cd -P -- "$d/$f" && pwd) || exit 4
real=$(cd -P -- "$d" && pwd) || exit 4
case $inner/ in "$real"/*) ;; *) echo "the bundle folder $f leads outside remote_dir" >&2; exit 4 ;; esac
rc=0
for p; do
  case /$p/ in */../*) echo "refused: $p" >&2; rc=4; continue ;; esac
  t=$inner/$p
  if [ -L "$t" ] || [ ! -f "$t" ]; then echo "refused: $p is not a regular file" >&2; rc=4; continue; fi
  case $(cd -P -- "$(dirname -- "$t")" && pwd)/ in "$inner"/*) ;; *) echo "refused: $p is outside" >&2; rc=4; continue ;; esac
  rm -f -- "$t" && echo "removed $f/$p" || rc=1
done
exit $rc
