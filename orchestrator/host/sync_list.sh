# shellcheck shell=bash
# $1 remote_dir: every directory, file and link under it but .kdtree/, NUL-terminated
# `KIND SIZE MTIME PATH` entries (the tar sync's listing).

cd -- "$1" && find . -mindepth 1 -path ./.kdtree -prune -o \( -type d -printf 'd 0 0 %P\0' \) \
  -o \( -type f -printf 'f %s %T@ %P\0' \) -o \( -type l -printf 'l 0 0 %P\0' \)
