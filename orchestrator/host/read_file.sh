# shellcheck shell=bash
# $1 a file, $2 the most bytes, $3 remote_dir: what kd_read prints (Transport.read_file). Sent
# after ownership.sh (run on $3) and read_function.sh.
kd_read "$1" "$2" "$(realpath -m -- "$3")" "$(realpath -m -- "$1")"
