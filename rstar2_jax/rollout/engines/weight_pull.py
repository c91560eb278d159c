"""Weight sync to vLLM servers that share no filesystem with the trainer: the servers pull.

    trainer host                                   each server host
    export -> sync dir --- WeightFileServer ----->  WeightFetcher (beside vLLM) -> its own dir
              (HTTP, read-only, a thread)           POST /fetch {"url", "files", "version"}
                                                    then vLLM reload_weights(that dir)

The trainer exports once (vllm_engine.push_to_servers), serves the export's files, asks every
server's fetcher to copy them (in parallel), then tells each vLLM server to reload from the path
its fetcher returned. `python -m rstar2_jax.rollout.serve --fetch_port P` runs a fetcher next to
the server; `python -m rstar2_jax.rollout.engines.weight_pull --port P --dir D` runs one alone.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import shutil
import threading
import urllib.request

CHUNK = 8 << 20


class WeightFileServer:
    """Serves `root` (read-only, GET only) over HTTP from a background thread."""

    def __init__(self, root: str, host: str = "127.0.0.1", advertise: str | None = None, port: int = 0):
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)
        handler = functools.partial(_QuietFiles, directory=self.root)
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
    def log_message(self, *args):  # one line per file per sync would flood the trainer's log
        pass


def fetch(base_url: str, files: list[str], dest: str, timeout: float = 600.0) -> str:
    """Copy `files` from `base_url` into `dest` (whole or not at all: a temporary directory is
    renamed when every file is there)."""
    for name in files:
        if "/" in name or name.startswith(".") or not name:
            raise ValueError(f"bad file name {name!r}")
    tmp = dest + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        for name in files:
            with urllib.request.urlopen(f"{base_url}/{name}", timeout=timeout) as src, \
                    open(os.path.join(tmp, name), "wb") as out:
                shutil.copyfileobj(src, out, CHUNK)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    return dest


class WeightFetcher:
    """Beside a vLLM server: copies exports it is told about into `root`/v<version> (keeping only
    the newest `keep`) and answers with the local path for reload_weights."""

    def __init__(self, root: str, host: str = "127.0.0.1", port: int = 0, keep: int = 2):
        self.root = os.path.abspath(root)
        self.keep = keep
        os.makedirs(self.root, exist_ok=True)
        fetcher = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                if self.path != "/fetch":
                    return self._reply(404, {"error": f"no route {self.path}; POST /fetch"})
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                    path = fetcher.fetch(str(body["url"]), [str(f) for f in body["files"]], int(body["version"]))
                    self._reply(200, {"path": path})
                except (KeyError, TypeError, ValueError) as e:
                    self._reply(400, {"error": f"bad request: {e!r}"})
                except OSError as e:
                    self._reply(502, {"error": f"could not copy the weights: {e!r}"})

            def _reply(self, status, obj):
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._httpd = http.server.ThreadingHTTPServer((host, port), Handler)
        self.port = self._httpd.server_address[1]
        self.url = f"http://{host}:{self.port}"
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="weight-fetcher", daemon=True)
        self._thread.start()

    def fetch(self, base_url: str, files: list[str], version: int) -> str:
        with self._lock:  # one sync at a time; older copies go once a newer one is whole
            dest = fetch(base_url, files, os.path.join(self.root, f"v{version}"))
            versions = sorted(int(d[1:]) for d in os.listdir(self.root) if d.startswith("v") and d[1:].isdigit())
            for old in versions[:-self.keep]:
                shutil.rmtree(os.path.join(self.root, f"v{old}"), ignore_errors=True)
            return dest

    def close(self):
        self._httpd.shutdown()
        self._httpd.server_close()


def ask_to_fetch(fetcher_url: str, files_url: str, files: list[str], version: int, timeout: float = 600.0) -> str:
    """Tell the fetcher at `fetcher_url` to copy an export; the path it holds the copy at."""
    req = urllib.request.Request(f"{fetcher_url.rstrip('/')}/fetch", method="POST",
                                 data=json.dumps({"url": files_url, "files": files, "version": version}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())["path"]


def main(argv=None):
    import argparse
    import signal

    p = argparse.ArgumentParser(description="Copy synced weights from the trainer for the vLLM server beside it.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8101)
    p.add_argument("--dir", default="/dev/shm/rstar2_pulled" if os.path.isdir("/dev/shm") else "/tmp/rstar2_pulled")
    args = p.parse_args(argv)
    fetcher = WeightFetcher(args.dir, args.host, args.port)
    print(f"weight fetcher on {fetcher.url}, copies into {fetcher.root}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    fetcher.close()


if __name__ == "__main__":
    main()
