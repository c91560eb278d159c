"""The pull path of weight sync without a vLLM server: the trainer's read-only file server, the
fetcher beside a server (real HTTP over loopback) copying an export bucket by bucket into a
partial copy that becomes whole on commit, old versions and abandoned partial copies dropped,
bad requests refused, strangers refused where the job has a secret."""

import json
import os
import urllib.error
import urllib.request

import pytest

from rstar2_jax.rollout.engines.vllm_engine.sync.fetcher import WeightFetcher, ask_to_commit, ask_to_fetch
from rstar2_jax.rollout.engines.vllm_engine.sync.file_server import WeightFileServer
from sandbox.job_secret import SECRET_ENV, OpenServiceError, bearer_headers

BUCKETS = [("model-b00000.safetensors", "b00000"), ("model-b00001.safetensors", "b00001")]


def export(root, version, size=1 << 20):
    d = root / "rstar2_sync_1" / f"v{version}"
    d.mkdir(parents=True)
    for file, _ in BUCKETS:
        (d / file).write_bytes(os.urandom(size))
    return d


def test_the_fetcher_copies_bucket_by_bucket_commits_whole_and_keeps_the_newest_two(tmp_path):
    files = WeightFileServer(str(tmp_path / "trainer"))
    fetcher = WeightFetcher(str(tmp_path / "server"), keep=2)
    server = tmp_path / "server"
    try:
        for version in (1, 2, 3):
            src = export(tmp_path / "trainer", version)
            for file, bucket in BUCKETS:
                part = ask_to_fetch(fetcher.url, files.url_for(str(src)), file, bucket, version)
                # what the server reloads at once: the bucket's directory, its file behind a link
                assert part == str(server / f"v{version}.partial" / bucket)
                assert open(os.path.join(part, "model.safetensors"), "rb").read() == (src / file).read_bytes()
                assert f"v{version}" not in os.listdir(server)  # not whole before the commit
            whole = ask_to_commit(fetcher.url, version)
            assert whole == str(server / f"v{version}")
            for file, bucket in BUCKETS:  # a whole reload reads the files; a bucket's link still holds
                assert (src / file).read_bytes() == open(os.path.join(whole, file), "rb").read()
                assert os.path.exists(os.path.join(whole, bucket, "model.safetensors"))
        assert sorted(os.listdir(server)) == ["v2", "v3"]
        with pytest.raises(ValueError, match="is not under"):
            files.url_for(str(tmp_path))
    finally:
        files.close()
        fetcher.close()
    assert not server.exists()  # its copies are memory in /dev/shm: gone with the fetcher


def test_a_fetcher_deletes_a_killed_one_s_copies_and_leaves_what_is_not_its_own(tmp_path):
    """A fetcher started where a killed one left copies deletes them (no sync will name them);
    closing, it deletes its own; neither touches anything else there."""
    (tmp_path / "server" / "v3").mkdir(parents=True)
    (tmp_path / "server" / "notes.txt").write_text("someone's")
    fetcher = WeightFetcher(str(tmp_path / "server"))
    assert os.listdir(tmp_path / "server") == ["notes.txt"]
    (tmp_path / "server" / "v7.partial").mkdir()
    fetcher.close()
    assert os.listdir(tmp_path / "server") == ["notes.txt"]


def test_a_sync_abandoned_half_way_is_dropped_by_the_next_commit(tmp_path):
    files = WeightFileServer(str(tmp_path / "trainer"))
    fetcher = WeightFetcher(str(tmp_path / "server"))
    try:
        ask_to_fetch(fetcher.url, files.url_for(str(export(tmp_path / "trainer", 4))), *BUCKETS[0], 4)  # then failed
        src = export(tmp_path / "trainer", 5)
        for file, bucket in BUCKETS:
            ask_to_fetch(fetcher.url, files.url_for(str(src)), file, bucket, 5)
        ask_to_commit(fetcher.url, 5)
        assert sorted(os.listdir(tmp_path / "server")) == ["v5"]
    finally:
        files.close()
        fetcher.close()


@pytest.mark.parametrize("route, body, status", [
    ("fetch", {"url": "http://127.0.0.1:1", "file": "../etc/passwd", "bucket": "b0", "version": 1}, 400),  # no tricks
    ("fetch", {"url": "http://127.0.0.1:1", "file": "m.safetensors", "bucket": "../x", "version": 1}, 400),
    ("fetch", {"url": "http://127.0.0.1:1", "file": "m.safetensors", "bucket": "b0"}, 400),            # no version
    ("fetch", {"url": "http://127.0.0.1:1", "file": "m.safetensors", "bucket": "b0", "version": 1}, 502),  # unreachable
    ("commit", {"version": 7}, 400),                                                                    # nothing copied
])
def test_the_fetcher_refuses_bad_requests_and_says_why(tmp_path, route, body, status):
    fetcher = WeightFetcher(str(tmp_path / "server"))
    try:
        req = urllib.request.Request(f"{fetcher.url}/{route}", data=json.dumps(body).encode(), method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == status and "error" in json.loads(e.value.read())
        left = [f for _, _, fs in os.walk(tmp_path / "server") for f in fs]
        assert left == []  # nothing half copied is left
    finally:
        fetcher.close()


def http_status(url: str, *, method: str = "GET", body: dict | None = None, secret: str | None = None) -> int:
    req = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers=bearer_headers(secret))
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_with_the_job_secret_both_servers_answer_only_its_holders(tmp_path, monkeypatch):
    """Issue 48, item 4: the export and the fetcher refuse a request without the secret (a
    stranger could otherwise read the policy, or make a server reload weights of their choosing),
    and the sync of the job's own processes, which carry it from their environment, goes through."""
    for service in (lambda host: WeightFileServer(str(tmp_path / "t"), host=host),
                    lambda host: WeightFetcher(str(tmp_path / "s"), host=host)):
        with pytest.raises(OpenServiceError, match="without a secret"):
            service("0.0.0.0")
    monkeypatch.setenv(SECRET_ENV, "job-s3cret")
    files = WeightFileServer(str(tmp_path / "trainer"))
    fetcher = WeightFetcher(str(tmp_path / "server"))
    try:
        src = export(tmp_path / "trainer", 1)
        file_url = f"{files.url_for(str(src))}/{BUCKETS[0][0]}"
        assert http_status(file_url) == 401 and http_status(file_url, secret="wrong") == 401
        assert http_status(file_url, secret="job-s3cret") == 200
        stranger = {"url": "http://127.0.0.1:1", "file": "m.safetensors", "bucket": "b0", "version": 1}
        assert http_status(f"{fetcher.url}/fetch", method="POST", body=stranger) == 401
        assert http_status(f"{fetcher.url}/commit", method="POST", body={"version": 1}, secret="wrong") == 401
        assert http_status(f"{fetcher.url}/anything") == 401
        for file, bucket in BUCKETS:
            ask_to_fetch(fetcher.url, files.url_for(str(src)), file, bucket, 1)
        whole = ask_to_commit(fetcher.url, 1)
        assert open(os.path.join(whole, BUCKETS[1][0]), "rb").read() == (src / BUCKETS[1][0]).read_bytes()
        assert not os.path.exists(tmp_path / "server" / "v1.partial")  # the stranger's fetch copied nothing
    finally:
        files.close()
        fetcher.close()
