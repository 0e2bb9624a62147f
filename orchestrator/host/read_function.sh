# shellcheck shell=bash
# kd_read FILE MAX ROOT REAL (ROOT and FILE resolved: REAL): FILE's first MAX + 1 bytes (more than
# MAX: the client refuses it), when it is a regular file inside ROOT and not a symlink; else an exit
# status of connectors/base.py's _READ_ERRORS. Included in read_file.sh and read_files.sh.

kd_read() {
  [ -L "$1" ] && return 3
  [ -e "$1" ] || return 4
  case $4 in "$3"/*) ;; *) return 7;; esac
  [ -f "$1" ] || return 5
  head -c "$(($2 + 1))" -- "$1"
}
