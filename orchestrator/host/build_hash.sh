# shellcheck shell=bash
# $1 remote_dir: the sha256sum line of every executable file under build/ (steps/executables.py).

cd -- "$1" || exit 3
find build -type f -perm /111 -print0 | sort -z | xargs -0 -r sha256sum --
exit 0
