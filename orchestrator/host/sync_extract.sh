# shellcheck shell=bash
# $1 remote_dir: extract the gzipped tar stream read on stdin into it (the tar sync).

cd -- "$1" && tar -xzf - --no-same-owner --no-same-permissions --no-overwrite-dir
