# shellcheck shell=bash
# $1 remote_dir, $2 the host's python, $3 steps/hash_inputs.py's source, then its arguments: run it in
# remote_dir (steps/inputs.py), in isolated mode.

cd -- "$1" || exit 3
exec "$2" -I -S -c "$3" "${@:4}"
