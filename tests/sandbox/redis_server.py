"""A real redis-server on a free loopback port, started and stopped by tests."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, port: int | None = None, password: str | None = None):
        """password: its requirepass, given as the SLURM launcher gives it (stdin, not the arguments)."""
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not installed (make test installs it)")
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.password = password
        self.proc = None

    def start(self) -> "RedisServer":
        config = ["-"] if self.password else []  # "-": the configuration from stdin
        self.proc = subprocess.Popen(["redis-server", *config, "--port", str(self.port), "--bind", "127.0.0.1",
                                      "--save", "", "--appendonly", "no", "--protected-mode", "no"],
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.proc.stdin.write(f"requirepass {self.password}\n".encode() if self.password else b"")
        self.proc.stdin.close()
        auth = f"AUTH {self.password}\r\n".encode() if self.password else b""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(auth + b"PING\r\n")
                    if b"+PONG" in s.recv(32):
                        return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
