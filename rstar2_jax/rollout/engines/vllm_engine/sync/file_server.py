"""The trainer's side of sync=pull (pull.py): a read-only HTTP server of its export directory,
one a process, which the fetchers beside the servers copy each bucket from."""

from __future__ import annotations

import functools
import http.server
import os
import threading

from rstar2_jax.rollout.engines.vllm_engine.sync.pull import refused
from sandbox.job_secret import check_open_service, is_loopback, job_secret


class WeightFileServer:
    """Serves `root` (read-only, GET only) over HTTP from a background thread, to holders of
    `secret` (default: $RSTAR2_SECRET)."""

    def __init__(self, root: str, host: str = "127.0.0.1", advertise: str | None = None, port: int = 0,
                 secret: str | None = None):
        self.root = os.path.abspath(root)
        self.secret = secret = secret or job_secret()
        check_open_service("the trainer's weight export server", host, secret)
        os.makedirs(self.root, exist_ok=True)
        handler = functools.partial(_QuietFiles, directory=self.root, secret=secret)
        self._httpd = http.server.ThreadingHTTPServer((host, port), handler)
        self.port = self._httpd.server_address[1]
        self.base_url = f"http://{advertise or host}:{self.port}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="weight-files", daemon=True)
        self._thread.start()

    def url_for(self, path: str) -> str:
        rel = os.path.relpath(os.path.abspath(path), self.root)
        if rel.startswith(".."):
            raise ValueError(f"{path} is not under {self.root}")
        return f"{self.base_url}/{rel}"

    def close(self):
        self._httpd.shutdown()
        self._httpd.server_close()


class _QuietFiles(http.server.SimpleHTTPRequestHandler):
    def __init__(self, *args, secret: str | None, **kwargs):
        self.secret = secret
        super().__init__(*args, **kwargs)

    def send_head(self):  # GET and HEAD both start here
        return None if refused(self, self.secret) else super().send_head()

    def log_message(self, *args):  # one line per file per sync would flood the trainer's log
        pass


_FILE_SERVERS: dict[tuple[str, str], "WeightFileServer"] = {}


def bind_address(sync_host: str) -> str:
    """Where the file server listens to be reached at `sync_host`: loopback, or every interface."""
    return sync_host if is_loopback(sync_host) else "0.0.0.0"


def file_server(root: str, host: str) -> "WeightFileServer":
    """This process's read-only HTTP server of `root` (one per root and address, started on first use)."""
    if (root, host) not in _FILE_SERVERS:
        server = _FILE_SERVERS[root, host] = WeightFileServer(root, host=bind_address(host), advertise=host)
        print(f"weight export served at {server.base_url} for the fetchers "
              f"({'they show the job secret' if server.secret else 'open: no secret'})", flush=True)
    return _FILE_SERVERS[root, host]
