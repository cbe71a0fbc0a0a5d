"""export.push_to_hub uploads the merged export through huggingface_hub's real client to a local
stand-in of the Hub's HTTP API ($HF_ENDPOINT), and no file anywhere holds the token.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/integration/test_push_to_hub.py

The stand-in answers the calls an upload makes (create the repo, validate the card's YAML, ask
how each file is uploaded - "regular", so contents travel inside the commit -, the commit) and
records what it received; anything else is a 404 that fails the test.
"""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.conftest import train

TOKEN = "hf_workbenchTestToken0123456789abcdef"


class Hub(BaseHTTPRequestHandler):
    received: dict = {}
    auth: list = []
    unknown: list = []

    def log_message(self, *a):  # quiet
        pass

    def _json(self, obj, code=200):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):  # noqa: N802 - http.server's naming
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        Hub.auth.append(self.headers.get("Authorization"))
        if self.path == "/api/repos/create":
            req = json.loads(body)
            host = self.headers.get("Host")
            return self._json({"url": f"http://{host}/{req.get('organization')}/{req['name']}"})
        if self.path == "/api/validate-yaml":  # the model card's front matter
            Hub.card_yaml = json.loads(body).get("content", "")
            return self._json({"errors": [], "warnings": []})
        if "/preupload/" in self.path:
            files = json.loads(body)["files"]
            return self._json({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                         for f in files]})
        if "/commit/" in self.path:
            for line in body.decode().splitlines():
                op = json.loads(line)
                if op.get("key") == "file":
                    Hub.received[op["value"]["path"]] = base64.b64decode(op["value"]["content"])
            host = self.headers.get("Host")
            oid = "0" * 40
            return self._json({"commitUrl": f"http://{host}/me/tiny-arith/commit/{oid}", "commitOid": oid})
        Hub.unknown.append(("POST", self.path))
        return self._json({"error": "unknown"}, 404)

    def do_GET(self):  # noqa: N802
        Hub.unknown.append(("GET", self.path))
        return self._json({"error": "unknown"}, 404)


@pytest.fixture
def hub(monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    Hub.received, Hub.auth, Hub.unknown = {}, [], []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    # the test suite runs offline (tests/conftest.py); this test talks only to the stand-in
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    yield Hub
    server.shutdown()


def test_push_uploads_the_export_and_no_file_holds_the_token(tmp_path, hub):
    res = train(["peft=lora", "train.max_steps=2", "train.export=true", "train.resume=never",
                 "export.parity_prompts=4", "export.gguf=[f16]", "export.push_to_hub=me/tiny-arith"], tmp_path)
    assert not hub.unknown, hub.unknown
    assert res["export"]["hub"]["repo"] == "me/tiny-arith"
    got = set(hub.received)
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "README.md",
            "gguf/model-f16.gguf"} <= got, got
    assert hub.received["model.safetensors"] == (tmp_path / "export" / "merged" / "model.safetensors").read_bytes()
    assert all(a == f"Bearer {TOKEN}" for a in hub.auth)
    secret = TOKEN.encode()
    assert not [p for p, data in hub.received.items() if secret in data]
    leaked = [p for p in tmp_path.rglob("*") if p.is_file() and secret in p.read_bytes()]
    assert not leaked, leaked


def test_push_without_a_token_is_refused_before_training(tmp_path, monkeypatch):
    from tests.conftest import compose
    from workbench.core.errors import UserError
    from workbench.run import preflight

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    cfg = compose(["train.export=true", "export.push_to_hub=me/x"], tmp_path)
    with pytest.raises(UserError, match="push-needs-token"):
        preflight.check(cfg)
