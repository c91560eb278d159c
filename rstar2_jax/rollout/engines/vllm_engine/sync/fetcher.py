"""The servers' side of sync=pull (pull.py): the WeightFetcher beside each vLLM server, which
copies the buckets of each export from the trainer's file server into its own directory, and the
trainer's calls to it (ask_to_fetch, ask_to_commit)."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import shutil
import tempfile
import threading
import urllib.request

from rstar2_jax.rollout.engines.vllm_engine.sync.pull import CHUNK, refused, reply
from sandbox.job_secret import bearer_headers, check_open_service, job_secret


def fetch_file(url: str, dest: str, timeout: float = 600.0, secret: str | None = None):
    """Copy `url` to `dest`, whole or not at all (a temporary name renamed once complete)."""
    tmp = dest + ".partial"
    request = urllib.request.Request(url, headers=bearer_headers(secret or job_secret()))
    try:
        with urllib.request.urlopen(request, timeout=timeout) as src, open(tmp, "wb") as out:
            shutil.copyfileobj(src, out, CHUNK)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    os.replace(tmp, dest)


def _checked_name(name: str, what: str) -> str:
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"bad {what} {name!r}")
    return name


def default_fetch_dir(port: int) -> str:
    """Where the fetcher on `port` keeps its copies: this host's memory (/dev/shm), one directory
    per fetcher (a killed one's copies are deleted by the next fetcher on its port)."""
    return os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(), f"rstar2_pulled_{port}")


class WeightFetcher:
    """Beside a vLLM server: copies the buckets of each export it is told about into
    `root`/v<version>.partial, which /commit renames `root`/v<version> (keeping only the newest
    `keep` whole versions), and answers with the local paths for reload_weights. Requests must
    carry `secret` (default: $RSTAR2_SECRET), which it also shows the export server."""

    def __init__(self, root: str, host: str = "127.0.0.1", port: int = 0, keep: int = 2, secret: str | None = None):
        self.root = os.path.abspath(root)
        self.keep = keep
        self.secret = secret = secret or job_secret()
        check_open_service("the weight fetcher", host, secret)
        os.makedirs(self.root, exist_ok=True)
        self._remove_versions()  # a previous fetcher's copies here (it was killed): no sync will name them
        fetcher = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                if not refused(self, secret):
                    reply(self, 404, {"error": f"no route {self.path}; POST /fetch or /commit"})

            def do_POST(self):
                if refused(self, secret):
                    return
                if self.path not in ("/fetch", "/commit"):
                    return reply(self, 404, {"error": f"no route {self.path}; POST /fetch or /commit"})
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                    if self.path == "/fetch":
                        path = fetcher.fetch_part(str(body["url"]), str(body["file"]), str(body["bucket"]),
                                                  int(body["version"]))
                    else:
                        path = fetcher.commit(int(body["version"]))
                    reply(self, 200, {"path": path})
                except (KeyError, TypeError, ValueError) as e:
                    reply(self, 400, {"error": f"bad request: {e!r}"})
                except OSError as e:
                    reply(self, 502, {"error": f"could not copy the weights: {e!r}"})

        self._httpd = http.server.ThreadingHTTPServer((host, port), Handler)
        self.port = self._httpd.server_address[1]
        self.url = f"http://{host}:{self.port}"
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="weight-fetcher", daemon=True)
        self._thread.start()

    def fetch_part(self, base_url: str, file: str, bucket: str, version: int) -> str:
        """One bucket's file from `base_url` into version `version`'s partial copy, with the
        bucket's own directory (a link to the file, what a partial reload reads); that directory."""
        _checked_name(file, "file name")
        _checked_name(bucket, "bucket name")
        partial = os.path.join(self.root, f"v{version}.partial")
        with self._lock:
            os.makedirs(os.path.join(partial, bucket), exist_ok=True)
            fetch_file(f"{base_url}/{file}", os.path.join(partial, file), secret=self.secret)
            link = os.path.join(partial, bucket, "model.safetensors")
            if not os.path.lexists(link):
                os.symlink(os.path.join("..", file), link)
            return os.path.join(partial, bucket)

    def commit(self, version: int) -> str:
        """Version `version`'s copy is whole: it becomes v<version>; older versions beyond the
        newest `keep`, and partial copies of older versions (syncs that failed), are deleted."""
        with self._lock:
            partial, dest = os.path.join(self.root, f"v{version}.partial"), os.path.join(self.root, f"v{version}")
            if not os.path.isdir(partial):
                raise ValueError(f"no copy of version {version} to commit (fetch its buckets first)")
            shutil.rmtree(dest, ignore_errors=True)
            os.replace(partial, dest)
            whole = sorted(int(d[1:]) for d in os.listdir(self.root) if d.startswith("v") and d[1:].isdigit())
            for old in whole[:-self.keep]:
                shutil.rmtree(os.path.join(self.root, f"v{old}"), ignore_errors=True)
            for d in os.listdir(self.root):
                if d.endswith(".partial") and d[1:-len(".partial")].isdigit() and int(d[1:-len(".partial")]) < version:
                    shutil.rmtree(os.path.join(self.root, d), ignore_errors=True)
            return dest

    def close(self):
        """Stop answering and delete the copies it made (in /dev/shm each is the model's size in
        memory, which would outlive the job on a shared node); `root` too, once nothing else is in it."""
        self._httpd.shutdown()
        self._httpd.server_close()
        with self._lock:
            self._remove_versions()
            try:
                os.rmdir(self.root)
            except OSError:  # something of someone else's is in it
                pass

    def _remove_versions(self):
        """Delete every copy in `root` (v<N> and v<N>.partial), nothing else."""
        for d in os.listdir(self.root) if os.path.isdir(self.root) else ():
            version = d[1:-len(".partial")] if d.endswith(".partial") else d[1:]
            if d.startswith("v") and version.isdigit():
                shutil.rmtree(os.path.join(self.root, d), ignore_errors=True)


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, method="POST", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **bearer_headers(job_secret())})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def ask_to_fetch(fetcher_url: str, files_url: str, file: str, bucket: str, version: int,
                 timeout: float = 600.0) -> str:
    """Tell the fetcher at `fetcher_url` to copy one bucket's `file` of the export at
    `files_url`; the path of that bucket's directory on the fetcher's host."""
    return _post(f"{fetcher_url.rstrip('/')}/fetch", {"url": files_url, "file": file, "bucket": bucket,
                                                      "version": version}, timeout)["path"]


def ask_to_commit(fetcher_url: str, version: int, timeout: float = 600.0) -> str:
    """Every bucket of `version` is copied: the path of the whole copy on the fetcher's host."""
    return _post(f"{fetcher_url.rstrip('/')}/commit", {"version": version}, timeout)["path"]
