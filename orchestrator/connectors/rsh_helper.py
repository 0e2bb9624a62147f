"""rsync's remote shell when it runs over the run's own SSH connection (orchestrator/connectors/relay.py).

rsync starts it as `python3 -I -S rsh_helper.py SOCKET [-l USER] HOST COMMAND...` (its `-e`). It
sends COMMAND (joined with spaces, as ssh does) to the relay listening on SOCKET, a Unix socket in
a private 0700 directory of the orchestrator process, which runs it on the host over the already
verified Paramiko connection; then it copies its stdin to the relay and the relay's frames to its
stdout and stderr, and exits with the remote command's exit status (255 when the relay fails).
Standard library only, no site packages (-S): it starts in ~20 ms, where an ssh handshake takes
a few hundred.

Frames from the relay: 1 byte kind (o: stdout, e: stderr, x: exit status), 4 bytes big-endian
length, payload (for x: a 4-byte big-endian signed exit status).
"""
import os
import socket
import struct
import sys
import threading

CHUNK = 64 * 1024


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def _pump_stdin(sock: socket.socket) -> None:
    try:
        while True:
            chunk = os.read(0, CHUNK)
            if not chunk:
                break
            sock.sendall(chunk)
    except OSError:
        pass
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def main(argv: list) -> int:
    if len(argv) < 3:
        print("usage: rsh_helper.py SOCKET [-l USER] HOST COMMAND...", file=sys.stderr)
        return 255
    path, args = argv[0], argv[1:]
    if args[0] == "-l":
        args = args[2:]
    command = " ".join(args[1:]).encode()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        sock.sendall(struct.pack(">I", len(command)) + command)
    except OSError as e:
        print(f"kdtree rsh relay: cannot reach {path}: {e}", file=sys.stderr)
        return 255
    threading.Thread(target=_pump_stdin, args=(sock,), daemon=True).start()
    buf = b""
    while True:
        chunk = sock.recv(CHUNK)
        if not chunk:
            print("kdtree rsh relay: the connection to the host ended without an exit status", file=sys.stderr)
            return 255
        buf += chunk
        while len(buf) >= 5:
            kind, size = buf[:1], struct.unpack(">I", buf[1:5])[0]
            if len(buf) < 5 + size:
                break
            payload, buf = buf[5:5 + size], buf[5 + size:]
            if kind == b"o":
                _write_all(1, payload)
            elif kind == b"e":
                _write_all(2, payload)
            elif kind == b"x":
                return struct.unpack(">i", payload)[0]


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)
