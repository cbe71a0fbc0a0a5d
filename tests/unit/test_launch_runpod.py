"""launcher=runpod against a local GraphQL server: the runpod SDK's real HTTP requests are
captured on 127.0.0.1 (RUNPOD_API_BASE_URL) and answered like RunPod would.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_launch_runpod.py
"""

from __future__ import annotations

import base64
import json
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from tests.conftest import compose
from workbench.core.errors import UserError

GPU = {"id": "NVIDIA H100 80GB HBM3", "displayName": "H100 SXM", "memoryInGb": 80, "maxGpuCount": 8}
NO_CAPACITY = "There are no longer any instances available with the requested specifications. Please refresh and try again."


class Api:
    """A stand-in for api.runpod.io/graphql: records requests, answers per scenario."""

    def __init__(self, scenario: str):
        self.scenario = scenario
        self.requests: list[dict] = []
        self.polls = 0

    def answer(self, query: str) -> tuple[int, dict]:
        if self.scenario == "auth":
            return 401, {"error": "unauthorized"}
        if self.scenario == "slow":
            time.sleep(2.0)
        if "myself" in query:  # the SDK looks up the network volume's data center
            return 200, {"data": {"myself": {"id": "u1", "networkVolumes": [
                {"id": "vol-9", "name": "wb", "size": 100, "dataCenterId": "EU-RO-1"}]}}}
        if "gpuTypes" in query:
            return 200, {"data": {"gpuTypes": [GPU]}}
        if "podFindAndDeployOnDemand" in query:
            if self.scenario == "no_capacity":
                return 200, {"errors": [{"message": NO_CAPACITY}]}
            return 200, {"data": {"podFindAndDeployOnDemand": {"id": "pod-123", "imageName": "img", "env": [],
                                                               "machineId": "m1", "machine": {"podHostId": "h"}}}}
        if "podStop" in query:
            return 200, {"data": {"podStop": {"id": "pod-123", "desiredStatus": "EXITED"}}}
        if "pod(input" in query:
            self.polls += 1
            if self.scenario == "never_starts":
                return 200, {"data": {"pod": {"id": "pod-123", "desiredStatus": "RUNNING", "runtime": None}}}
            if self.polls == 1:
                pod = {"id": "pod-123", "desiredStatus": "RUNNING", "runtime": None}
            elif self.polls == 2:
                pod = {"id": "pod-123", "desiredStatus": "RUNNING", "runtime": {"uptimeInSeconds": 5, "ports": []}}
            else:  # the job ended and the pod stopped itself
                pod = {"id": "pod-123", "desiredStatus": "EXITED", "runtime": None}
            return 200, {"data": {"pod": pod}}
        return 200, {"errors": [{"message": f"unexpected query {query[:40]}"}]}


@pytest.fixture
def api(monkeypatch):
    state = {"api": None}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's naming
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            a = state["api"]
            a.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "query": body["query"]})
            code, payload = a.answer(body["query"])
            data = json.dumps(payload).encode()
            try:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout test)
                pass

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("RUNPOD_API_BASE_URL", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setenv("RUNPOD_API_KEY", "rp-test-key")
    monkeypatch.setenv("HF_TOKEN", "hf-secret-value")

    def use(scenario: str) -> Api:
        state["api"] = Api(scenario)
        return state["api"]

    yield use
    server.shutdown()
    server.server_close()


def _cfg(tmp_path, *extra):
    return compose(["launcher=runpod", "hardware.device=cuda", "hardware.accelerator=H100", "hardware.procs=8",
                    "launcher.network_volume_id=vol-9", "launcher.image=ghcr.io/acme/workbench:abc123",
                    "launcher.poll_seconds=0", *extra], tmp_path / "run")


def _launch(cfg):
    from workbench.launch import runpod_pod

    ticks = iter(range(0, 10**6, 60))  # each poll is one minute later
    return runpod_pod.launch(cfg, sleep=lambda s: None, clock=lambda: next(ticks))


def _field(query: str, name: str) -> str:
    m = re.search(rf'{name}:\s*("(?:[^"\\]|\\.)*"|\[.*?\]|[^,\s}}]+)', query, re.S)
    assert m, f"{name} not in the mutation"
    return m.group(1)


def test_pod_created_polled_and_payload(api, tmp_path):
    a = api("ok")
    out = _launch(_cfg(tmp_path))
    queries = [r["query"] for r in a.requests]
    assert all(r["path"] == "/graphql" and r["auth"] == "Bearer rp-test-key" for r in a.requests)
    deploy = next(q for q in queries if "podFindAndDeployOnDemand" in q)
    assert _field(deploy, "gpuTypeId") == '"NVIDIA H100 80GB HBM3"'
    assert _field(deploy, "gpuCount") == "8"
    assert _field(deploy, "imageName") == '"ghcr.io/acme/workbench:abc123"'
    assert _field(deploy, "networkVolumeId") == '"vol-9"'
    assert _field(deploy, "dataCenterId") == '"EU-RO-1"'
    assert _field(deploy, "cloudType") == "SECURE"
    docker_args = _field(deploy, "dockerArgs")
    assert "python -m workbench --config-path /workspace/runs/run/launch --config-name job_config" in docker_args
    assert "output_dir=/workspace/runs/run" in docker_args and "runpodctl stop pod" in docker_args
    env = dict(re.findall(r'\{\s*key:\s*"([^"]+)",\s*value:\s*"([^"]*)"\s*\}', _field(deploy, "env")))
    assert env["HF_TOKEN"] == "hf-secret-value"  # from this shell's environment
    assert "RUNPOD_API_KEY" not in env
    shipped = yaml.safe_load(base64.b64decode(env["WORKBENCH_JOB_CONFIG"]))
    assert shipped["launcher"] == {"name": "local"} and shipped["hardware"]["procs"] == 8
    assert shipped["model"]["name"] == "tiny"
    assert json.loads(base64.b64decode(env["WORKBENCH_JOB_MANIFEST"]))["launcher"] == "runpod"
    # polled until the pod stopped itself; no stop needed from here
    assert a.polls == 3 and not any("podStop" in q for q in queries)
    assert out["runpod"]["pod_id"] == "pod-123" and out["runpod"]["final_status"] == "EXITED"
    # the local run dir records what was sent, without secret values
    launch_dir = tmp_path / "run" / "launch"
    assert yaml.safe_load((launch_dir / "job_config.yaml").read_text()) == shipped
    record = (launch_dir / "launch.json").read_text()
    assert "hf-secret-value" not in record and "rp-test-key" not in record
    assert json.loads(record)["runpod"]["env_names"] == ["HF_TOKEN"]


def test_auth_failure_is_one_clear_line(api, tmp_path):
    api("auth")
    with pytest.raises(UserError, match="authentication failed.*RUNPOD_API_KEY"):
        _launch(_cfg(tmp_path))


def test_no_capacity_is_explained(api, tmp_path):
    api("no_capacity")
    with pytest.raises(UserError, match="no capacity for this GPU request.*launcher.gpu_type"):
        _launch(_cfg(tmp_path))


def test_pod_that_never_starts_is_stopped(api, tmp_path):
    a = api("never_starts")
    with pytest.raises(UserError, match=r"did not start within launcher.start_timeout_minutes=2 .*it was stopped"):
        _launch(_cfg(tmp_path, "launcher.start_timeout_minutes=2"))
    assert any('podStop(input: { podId: "pod-123" })' in r["query"] for r in a.requests)


def test_api_timeout_is_explained(api, tmp_path, monkeypatch):
    import requests
    import runpod.api.graphql as gql

    real_post = requests.post
    # The SDK waits 30 s; the server here answers after 2 s, so shorten the client's patience.
    monkeypatch.setattr(gql.requests, "post", lambda *a, **k: real_post(*a, **{**k, "timeout": 0.3}))
    api("slow")
    with pytest.raises(UserError, match="did not answer in time"):
        _launch(_cfg(tmp_path))


def test_missing_api_key(api, tmp_path, monkeypatch):
    import runpod

    monkeypatch.delenv("RUNPOD_API_KEY")
    monkeypatch.setattr(runpod, "api_key", None)
    with pytest.raises(UserError, match="RUNPOD_API_KEY"):
        _launch(_cfg(tmp_path))


def test_missing_runpod_package_gives_install_hint(tmp_path, monkeypatch):
    from workbench.launch import runpod_pod

    monkeypatch.setitem(sys.modules, "runpod", None)
    with pytest.raises(UserError, match=r"'runpod' is not installed.*pip install -e '\.\[runpod\]'"):
        runpod_pod.launch(_cfg(tmp_path))


def test_cpu_profile_needs_a_gpu_type(tmp_path):
    from workbench.launch import runpod_pod

    cfg = compose(["launcher=runpod"], tmp_path / "run")
    with pytest.raises(UserError, match="launcher.gpu_type"):
        runpod_pod.gpu_type(cfg, runpod_pod.Config())
