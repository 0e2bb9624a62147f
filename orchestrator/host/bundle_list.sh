# shellcheck shell=bash
# Arguments: remote_dir, the bundle folder relative to it. The folder must be a real folder inside
# remote_dir (no link on the way out); prints "BYTES RELATIVE-PATH" for each *.kdtr regular file.

d=$1 f=$2
[ -d "$d/$f" ] || exit 0
real=$(cd -P -- "$d" && pwd) && inner=$(cd -P -- "$d/$f" && pwd) || exit 4
case $inner/ in "$real"/*) ;; *) echo "the bundle folder $f leads outside remote_dir" >&2; exit 4 ;; esac
cd -P -- "$d/$f" && find . -xdev -type f -name '*.kdtr' -printf '%s %P\n'
