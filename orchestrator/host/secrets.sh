# shellcheck shell=bash
# remote.SECRETS: $1 the secret variables' names (comma-separated), then the command: each value is
# read from stdin up to a NUL byte and exported, then the command runs with the rest of stdin (GUARD's).
IFS=, read -r -a names <<< "$1"; shift
for n in "${names[@]}"; do IFS= read -r -d '' v || exit 125; export "$n=$v"; done
unset n v names
exec "$@"
