# shellcheck shell=bash
# shellcheck disable=SC2242  # @NO_MATCH@ is a number by the time the script is sent (below)
# $1 remote_dir, then the records: each the words "SHA256 PATH" of its executables, then "--".
# Prints the sha256sum line of every recorded path that is an executable file under build/; then,
# when every executable of one record hashes as recorded, @MATCHED@ (exit 0), else exits
# @NO_MATCH@ (steps/executables.py's MATCHED and NO_MATCH, put in when it is loaded).

cd -- "$1" || exit 3; shift
paths=(); for a; do [ "$a" = -- ] || paths+=("${a#* }"); done
sums=$(find build -type f -perm /111 -print0 | sort -z | grep -zxF -f <(printf '%s\n' "${paths[@]}") |
       xargs -0 -r sha256sum --)
[ -n "$sums" ] && printf '%s\n' "$sums"
want=
for a; do
  if [ "$a" != -- ]; then want+="${a%% *}  ${a#* }"$'\n'; continue; fi
  if [ -n "$want" ] && ! grep -vxqF -f <(printf '%s\n' "$sums") <<< "${want%$'\n'}"; then
    printf '%s\n' @MATCHED@; exit 0
  fi
  want=
done
exit @NO_MATCH@
