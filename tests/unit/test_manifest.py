"""Secrets never reach the run directory; ordinary settings that merely mention tokens do."""

from __future__ import annotations

from workbench.telemetry.manifest import REDACTED, redact


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
