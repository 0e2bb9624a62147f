# shellcheck shell=bash
# $1 remote_dir, $2 a mark, then FILE MAX pairs: for each, what kd_read printed, a newline, the
# mark, a space, kd_read's exit status and a newline (Transport.read_files; one realpath for every
# file). Sent after ownership.sh and read_function.sh.

d=$(realpath -m -- "$1") mark=$2; shift 2
files=(); for ((i = 1; i < $#; i += 2)); do files+=("${!i}"); done
readarray -d '' real < <(realpath -zm -- "${files[@]}")
[ "${#real[@]}" = "${#files[@]}" ] || exit 3
i=0
while [ $# -ge 2 ]; do
  kd_read "$1" "$2" "$d" "${real[i]}"
  printf '\n%s %s\n' "$mark" "$?"
  shift 2; i=$((i + 1))
done
