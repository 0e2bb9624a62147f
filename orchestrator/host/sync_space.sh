# shellcheck shell=bash
# $1 remote_dir: its filesystem's free kB, then the kB it holds (sync: why rsync failed).

df -Pk -- "$1" | awk 'NR == 2 {print $4}'
du -sk -- "$1" | cut -f1
