# shellcheck shell=bash
# $1 remote_dir: delete the build's executables, so a build that fails leaves none behind (steps/build.py).

cd -- "$1" && { [ ! -d build ] || find build -type f -perm /111 -delete; }
