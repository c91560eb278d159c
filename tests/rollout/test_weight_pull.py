"""The pull path of weight sync without a vLLM server: the trainer's read-only file server, the
fetcher beside a server (real HTTP over loopback), whole copies, old versions dropped, bad
requests refused."""

import json
import os
import urllib.error
import urllib.request

import pytest

from rstar2_jax.rollout.engines.weight_pull import WeightFetcher, WeightFileServer, ask_to_fetch


def export(root, version, size=1 << 20):
    d = root / "rstar2_sync_1" / f"v{version}"
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(os.urandom(size))
    (d / "config.json").write_text(json.dumps({"version": version}))
    return d


def test_the_fetcher_copies_each_export_whole_and_keeps_the_newest_two(tmp_path):
    files = WeightFileServer(str(tmp_path / "trainer"))
    fetcher = WeightFetcher(str(tmp_path / "server"), keep=2)
    try:
        for version in (1, 2, 3):
            src = export(tmp_path / "trainer", version)
            path = ask_to_fetch(fetcher.url, files.url_for(str(src)), ["config.json", "model.safetensors"], version)
            assert path == str(tmp_path / "server" / f"v{version}")
            for name in ("config.json", "model.safetensors"):
                assert (src / name).read_bytes() == open(os.path.join(path, name), "rb").read()
        assert sorted(os.listdir(tmp_path / "server")) == ["v2", "v3"]
        with pytest.raises(ValueError, match="is not under"):
            files.url_for(str(tmp_path))
    finally:
        files.close()
        fetcher.close()


@pytest.mark.parametrize("body, status", [
    ({"url": "http://127.0.0.1:1", "files": ["../etc/passwd"], "version": 1}, 400),   # no path tricks
    ({"url": "http://127.0.0.1:1", "files": ["model.safetensors"]}, 400),             # no version
    ({"url": "http://127.0.0.1:1", "files": ["model.safetensors"], "version": 1}, 502),  # trainer unreachable
])
def test_the_fetcher_refuses_bad_requests_and_says_why(tmp_path, body, status):
    fetcher = WeightFetcher(str(tmp_path / "server"))
    try:
        req = urllib.request.Request(f"{fetcher.url}/fetch", data=json.dumps(body).encode(), method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == status and "error" in json.loads(e.value.read())
        assert os.listdir(tmp_path / "server") == []  # nothing half copied is left
    finally:
        fetcher.close()
