#!/usr/bin/env bash
# Run on a machine with the Debian 12 archive and PyPI: fetches what the offline GPU host lacks
# into the repo's .debs/ (OpenSSH server and client, rsync, their libraries) and .whl/ (the
# orchestrator's Python dependencies for CPython 3.12). Both folders are git-ignored; the device
# tool carries them (carry: [".debs", ".whl"]).
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .debs .whl
(cd .debs && apt-get download openssh-server openssh-sftp-server openssh-client rsync libwrap0 libpopt0 \
    libxxhash0 libnsl2 libtirpc3 libtirpc-common libfido2-1 libcbor0.8 libedit2)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
    fabric==3.2.3 invoke==2.2.1 paramiko==5.1.0 bcrypt==5.0.0 cryptography==48.0.0 pynacl==1.6.2 \
    cffi==2.0.0 pycparser==3.0 decorator==5.2.1 deprecated==1.3.1 wrapt==2.1.2
ls .debs .whl
