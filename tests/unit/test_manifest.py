"""Secrets never reach the run directory; ordinary settings that merely mention tokens do."""

from __future__ import annotations

from types import SimpleNamespace

from workbench.core.secrets import REDACTED, redact
from workbench.telemetry import manifest

TOKEN = "hf_" + "Zq7" * 12


def test_secret_keys_are_redacted_and_settings_are_kept():
    cfg = {"hf_token": "hf_abc", "wandb_api_key": "k", "token": "t", "password": "p", "aws_secret_access_key": "s",
           "launcher": {"api_key": "q", "secrets": ["hf-secret-name"]},
           "model": {"tokenizer": "smollm2-135m", "arch": {"experts_per_token": 2}},
           "eval": {"max_new_tokens": 8}, "plan": {"tokens": 1000}}
    out = redact(cfg)
    for key in ("hf_token", "wandb_api_key", "token", "password", "aws_secret_access_key"):
        assert out[key] == REDACTED
    assert out["launcher"]["api_key"] == REDACTED
    assert out["launcher"]["secrets"] == ["hf-secret-name"]  # names of Modal secrets, not values
    assert out["model"] == cfg["model"] and out["eval"] == cfg["eval"] and out["plan"] == cfg["plan"]


def test_the_whole_manifest_is_redacted_not_only_its_config():
    contract = SimpleNamespace(template_hash="abc", end_of_turn="<|im_end|>", end_of_turn_id=2)
    man = manifest.build({"launcher": {"note": TOKEN}, "eval": {"max_new_tokens": 8}},
                         {"kind": "hub", "name": f"https://user:{TOKEN}@example.com/model"},
                         {"sources": [{"path": f"/data/{TOKEN}/rows.jsonl", "rows": 3}]}, contract)
    assert TOKEN not in repr(man)
    assert man["config"] == {"launcher": {"note": REDACTED}, "eval": {"max_new_tokens": 8}}
    assert man["model_source"]["name"] == f"https://user:{REDACTED}@example.com/model"
    assert man["data"]["sources"][0] == {"path": f"/data/{REDACTED}/rows.jsonl", "rows": 3}
