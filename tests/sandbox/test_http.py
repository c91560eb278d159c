"""HTTP API: native routes, code-judge compatibility, metrics, and 4xx for bad requests."""

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from sandbox.http_service.api import SandboxHTTPServer
from tests.sandbox.helpers import prometheus_total
from tests.sandbox.redis_server import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def api(sb):
    server = SandboxHTTPServer(sb.sb, default_timeout=5.0, max_body_bytes=1 << 20, workers=sb.sb.workers)
    port = sb.call(server.start("127.0.0.1", 0))
    yield f"http://127.0.0.1:{port}", server
    sb.call(server.close())


def request(url, method="GET", body=None, raw=None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            payload = resp.read().decode()
            return resp.status, (json.loads(payload) if resp.headers["Content-Type"] == "application/json" else payload)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


def test_native_run_and_batch(api):
    url, _ = api
    status, body = request(url + "/run", "POST", {"code": "print(input()[::-1])", "stdin": "abc", "timeout": 2})
    assert status == 200 and body["status"] == "ok" and body["stdout"] == "cba\n"
    assert set(body) == {"status", "stdout", "stderr", "exit_code", "duration_s", "truncated"}
    status, body = request(url + "/run/batch", "POST", {"requests": [{"code": f"print({i})"} for i in range(10)]})
    assert [r["stdout"] for r in body["results"]] == [f"{i}\n" for i in range(10)]
    assert request(url + "/health")[1]["status"] == "ok"


def test_code_judge_api_as_rstar2_agent_calls_it(api):
    url, _ = api
    # The exact body of rStar2-Agent's call_long_batch.
    body = {"type": "batch", "submissions": [
        {"type": "python", "solution": "print(int(input()) + 1)", "input": "41"},
        {"type": "python", "solution": "1/0", "input": ""},
        {"type": "cpp", "solution": "int main(){}", "input": ""},
    ]}
    status, out = request(url + "/run/long-batch", "POST", body)
    assert status == 200 and len(out["results"]) == 3
    ok, err, cpp = out["results"]
    assert ok["run_success"] and ok["success"] and ok["stdout"] == "42\n" and ok["reason"] == ""
    assert isinstance(ok["cost"], float) and "sub_id" in ok
    assert not err["run_success"] and "ZeroDivisionError" in err["stderr"]
    assert cpp["reason"] == "invalid_input" and not cpp["success"]


def test_code_judge_single_and_judge_variants(api):
    url, _ = api
    sub = {"type": "python", "solution": "print(6 * 7)", "expected_output": "42"}
    status, out = request(url + "/run", "POST", sub)
    assert out["success"] and out["run_success"] and out["stdout"] == "42\n"
    _, wrong = request(url + "/run", "POST", {**sub, "expected_output": "41"})
    assert wrong["run_success"] and not wrong["success"]
    _, judged = request(url + "/judge", "POST", sub)
    assert judged["success"] and "stdout" not in judged
    for route in ("/judge/batch", "/judge/long-batch", "/run/batch", "/run/long-batch"):  # code-judge's batch routes
        status, batch = request(url + route, "POST", {"type": "batch", "submissions": [sub, {**sub, "expected_output": "1"}]})
        assert status == 200 and [r["success"] for r in batch["results"]] == [True, False], route
        assert all(("stdout" in r) == route.startswith("/run") for r in batch["results"]), route
    _, timeout = request(url + "/run", "POST", {"type": "python", "solution": "while True: pass"})
    assert timeout["reason"] == "worker_timeout"
    assert request(url + "/ping") == (200, "pong")
    status, st = request(url + "/status")
    assert status == 200 and st["num_workers"] == 3 and "queue" in st


def _results_total(url):
    _, text = request(url + "/metrics")
    return int(prometheus_total(text, "sandbox_results_total"))


@pytest.mark.parametrize("path,body,code,message", [
    ("/run", {"stdin": "x"}, 400, "missing field 'code'"),
    ("/run", {"code": 5}, 400, "code must be a string"),
    ("/run", {"code": "1", "stdin": 3}, 400, "stdin must be a string"),
    ("/run", {"code": "1", "timeout": 0}, 400, "timeout must be in"),
    ("/run", {"code": "1", "timeout": 1e9}, 400, "timeout must be in"),
    ("/run", [1, 2], 400, "must be a JSON object"),
    ("/run/batch", {"requests": [{"code": "1"}, {"code": None}]}, 400, "code must be a string"),
    ("/run/long-batch", {"type": "batch", "submissions": []}, 400, "'submissions' must be a list"),
    ("/run/batch", {"type": "batch", "submissions": [{"type": "python"}]}, 400, "needs a string 'solution'"),
    ("/nope", {}, 404, "no route /nope"),
])
def test_bad_requests_get_4xx_and_never_reach_a_worker(api, path, body, code, message):
    url, _ = api
    before = _results_total(url)
    status, out = request(url + path, "POST", body)
    assert status == code and message in out["error"]
    assert _results_total(url) == before


def test_invalid_json_oversize_body_and_wrong_method(api):
    url, _ = api
    status, out = request(url + "/run", "POST", raw=b'{"code": "1",\n oops}')
    assert status == 400 and "invalid JSON body: line 2" in out["error"]
    status, out = request(url + "/run", "POST", raw=b'{"code": "' + b"x" * (2 << 20) + b'"}')
    assert status == 413 and "limit" in out["error"]
    status, out = request(url + "/run", "GET")
    assert status == 405


def test_metrics_are_prometheus_text(api):
    url, _ = api
    request(url + "/run", "POST", {"code": "print(1)"})
    status, text = request(url + "/metrics")
    assert status == 200
    for name in ("sandbox_queue_depth", "sandbox_in_flight", 'sandbox_results_total{status="ok"}',
                 'sandbox_latency_seconds_bucket{le="+Inf"}', "sandbox_latency_seconds_count"):
        assert name in text


def test_keep_alive_serves_several_requests_on_one_connection(api):
    url, _ = api
    port = int(url.rsplit(":", 1)[1])
    body = json.dumps({"code": "print(3)"}).encode()
    req = (b"POST /run HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
           + str(len(body)).encode() + b"\r\n\r\n" + body)
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(req * 2)
        data = b""
        while data.count(b'"stdout": "3\\n"') < 2:
            data += s.recv(65536)
    assert data.count(b"HTTP/1.1 200 OK") == 2


def test_serve_cli_end_to_end():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sandbox", "serve", "--port", str(port), "--workers", "2"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        while not any("sandbox serving on" in line for line in lines):  # log lines come first
            lines.append(proc.stdout.readline())
            assert lines[-1] and len(lines) < 20, lines
        status, out = request(f"http://127.0.0.1:{port}/run", "POST", {"code": "import sympy\nsympy.sqrt(8)"})
        assert status == 200 and out["stdout"] == "2*sqrt(2)\n"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0


def test_sessions_over_http_keep_state_per_id_and_refuse_unknown_ids(api):
    url, server = api
    status, opened = request(url + "/session", "POST")
    assert status == 200 and len(opened["session"]) >= 24  # unguessable: the id is the only key
    other = request(url + "/session", "POST")[1]["session"]
    cell = f"{url}/session/{opened['session']}/run"
    assert request(cell, "POST", {"code": "x = 20"})[1]["status"] == "ok"
    status, body = request(cell, "POST", {"code": "x += 1\nprint(input() * x)", "stdin": "ab"})
    assert status == 200 and body["stdout"] == "ab" * 21 + "\n"
    assert request(f"{url}/session/{other}/run", "POST", {"code": "print('x' in globals())"})[1]["stdout"] == "False\n"
    assert request(cell, "POST", {"code": 42})[0] == 400
    assert request(cell, "GET")[0] == 405
    assert request(f"{url}/session/{opened['session']}/stop", "POST", {})[0] == 404
    assert request(f"{url}/session/{opened['session']}", "DELETE") == (200, {"closed": True})
    status, body = request(cell, "POST", {"code": "print(x)"})
    assert status == 404 and "open a new one" in body["error"]
    assert request(f"{url}/session/not-an-id/run", "POST", {"code": "1"})[0] == 404
    request(f"{url}/session/{other}", "DELETE")
    assert server._sessions == {}


def test_http_session_cap_is_a_503_saying_why():
    from tests.sandbox.helpers import SyncSandbox
    box = SyncSandbox(workers=1, preload=("math",), max_sessions=1, session_wait_s=0.1)
    server = SandboxHTTPServer(box.sb, workers=1)
    port = box.call(server.start("127.0.0.1", 0))
    try:
        assert request(f"http://127.0.0.1:{port}/session", "POST")[0] == 200
        status, body = request(f"http://127.0.0.1:{port}/session", "POST")
        assert status == 503 and "all 1 sessions of this sandbox are open" in body["error"]
    finally:
        box.call(server.close())
        box.close()


def test_http_sandbox_client_sessions_and_a_lost_session_is_reopened_with_a_note(api, sb):
    import sandbox
    url, server = api

    async def trajectory():
        async with sandbox.HTTPSandbox(url) as client:
            async with await client.session() as s:
                first = [await s.run("x = 1"), await s.run("x + 1")]
                for live in list(server._sessions.values()):  # the service loses it (e.g. it expired)
                    await live.close()
                lost = await s.run("print('x' in globals())")
                again = await s.run("y = 5\ny")
            return first, lost, again, s.restarts

    first, lost, again, restarts = sb.call(trajectory())
    assert [r.status for r in first] == ["ok", "ok"] and first[1].stdout == "2\n"
    assert lost.stdout == "False\n" and "lost this session" in lost.stderr and restarts == 1
    assert again.stdout == "5\n"
    assert server._sessions == {}  # closed at the end of the `async with`
