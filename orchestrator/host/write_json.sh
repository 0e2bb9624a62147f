# shellcheck shell=bash
# $1 remote_dir, $2 a file name: stdin stored as .kdtree/$2, atomically (state.write_json).

cd -- "$1/.kdtree" && cat > "$2.tmp" && mv -f -- "$2.tmp" "$2"
