"""The vLLM servers' guard (issue 48, item 4): `rstar2_vllm_auth.RequireSecret`, mounted the way
vLLM 0.32 mounts a `--middleware` class (`app.add_middleware(cls)`,
vllm/entrypoints/serve/middleware/register.py), on a FastAPI app with the routes RL turns on, in
the vLLM venv (its FastAPI and Starlette): every route refuses a request without the secret,
/health and the dev-mode weight routes included, which vLLM's own --api-key leaves open. The
whole server with it runs in the SLURM test (tests/rl/test_scale_out.py)."""

import json
import os
import subprocess

import pytest

from rstar2_jax.rollout.engines.vllm_engine.server import (AUTH_MIDDLEWARE, AUTH_PLUGIN_DIR, ServerOptions, server_command,
                                                    shell_command)
from tests.rl.launch import ROOT

VLLM_PYTHON = os.path.join(ROOT, ".venv-vllm", "bin", "python")

CHECK = r"""
import json
from fastapi import FastAPI, WebSocket
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect
import rstar2_vllm_auth

app = FastAPI()
for path in ("/v1/models", "/health", "/metrics", "/collective_rpc", "/pause", "/update_weight_version"):
    app.add_api_route(path, lambda: {"ok": True}, methods=["GET", "POST"])

@app.websocket("/v1/realtime")
async def realtime(ws: WebSocket):
    await ws.accept()
    await ws.send_text("hello")
    await ws.close()

app.add_middleware(rstar2_vllm_auth.RequireSecret)  # what vLLM does with --middleware rstar2_vllm_auth.RequireSecret
out = {}
with TestClient(app) as client:
    for path in ("/v1/models", "/health", "/metrics", "/collective_rpc", "/pause", "/update_weight_version"):
        out[path] = [client.post(path).status_code, client.post(path, headers={"Authorization": "Bearer wrong"}).status_code,
                     client.post(path, headers={"Authorization": "Bearer job-s3cret"}).status_code]
    try:
        with client.websocket_connect("/v1/realtime") as ws:
            ws.receive_text()
        out["ws_without"] = "open"
    except WebSocketDisconnect as e:
        out["ws_without"] = e.code
    with client.websocket_connect("/v1/realtime", headers={"Authorization": "Bearer job-s3cret"}) as ws:
        out["ws_with"] = ws.receive_text()
print(json.dumps(out))
"""


def test_every_route_of_a_vllm_app_refuses_requests_without_the_job_secret():
    if not os.path.exists(VLLM_PYTHON):
        pytest.fail(f"{VLLM_PYTHON} is missing: `make test` installs it (make venv-vllm)")
    env = {**os.environ, "RSTAR2_SECRET": "job-s3cret", "PYTHONPATH": AUTH_PLUGIN_DIR}
    done = subprocess.run([VLLM_PYTHON, "-c", CHECK], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for path in ("/v1/models", "/health", "/metrics", "/collective_rpc", "/pause", "/update_weight_version"):
        assert out[path] == [401, 401, 200], (path, out[path])
    assert out["ws_without"] == 1008 and out["ws_with"] == "hello"
    # without the secret in its environment the guard refuses to be built (no open server by accident)
    env.pop("RSTAR2_SECRET")
    done = subprocess.run([VLLM_PYTHON, "-c", CHECK], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "RSTAR2_SECRET is not set" in done.stderr


def test_the_server_command_mounts_the_guard_and_never_shows_the_secret(monkeypatch):
    monkeypatch.setenv("RSTAR2_SECRET", "job-s3cret")
    argv, env = server_command("/m", ServerOptions(host="0.0.0.0"), "/py", require_secret=True)
    assert argv[argv.index("--middleware") + 1] == AUTH_MIDDLEWARE
    assert env["PYTHONPATH"].split(os.pathsep)[0] == AUTH_PLUGIN_DIR
    assert os.path.exists(os.path.join(AUTH_PLUGIN_DIR, AUTH_MIDDLEWARE.split(".")[0] + ".py"))
    assert "job-s3cret" not in shell_command(argv, env)  # what rollout.serve prints
    argv, _ = server_command("/m", ServerOptions(), "/py")
    assert "--middleware" not in argv
