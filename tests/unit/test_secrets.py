"""The one redaction rule (workbench/core/secrets.py): a value is secret when its key looks
secret or when it is token-shaped, wherever it sits; ordinary settings that mention tokens stay.
End-to-end runs through the CLI are in tests/integration/test_hydra_secrets.py."""

from __future__ import annotations

import logging

from omegaconf import OmegaConf

from workbench.core.secrets import (
    REDACTED,
    LogFilter,
    redact,
    redact_overrides,
    scrub_files,
    scrub_text,
    secret_values,
)

HF = "hf_" + "Zq7" * 12
SK = "sk-" + "proj-" + "a1B2" * 6
GH = "ghp_" + "X9y8" * 6
PAT = "github_pat_" + "11AB" * 6


def test_token_shapes_are_found_inside_longer_strings():
    for text, want in [
        (f"Bearer {HF}", f"Bearer {REDACTED}"),
        (f"https://user:{GH}@github.com/o/r.git", f"https://user:{REDACTED}@github.com/o/r.git"),
        (f"https://x.org/api?key={SK}&n=1", f"https://x.org/api?key={REDACTED}&n=1"),
        (f"my_{HF}", f"my_{REDACTED}"),  # `_` before the token: still a token
        (f"{PAT}\n", f"{REDACTED}\n"),
    ]:
        assert scrub_text(text) == want
    # `sk-` inside a word is not a key, nor a short hf_ name
    for plain in ("task-arith-two-digit-addition-heldout", "disk-usage-report-for-the-cluster-1",
                  "hf_hub", "max_new_tokens=12", "model.tokenizer=smollm2-135m"):
        assert scrub_text(plain) == plain


def test_redact_applies_key_and_shape_rules_at_any_depth():
    cfg = {"launcher": {"note": HF, "header": f"Bearer {SK}", "api_key": "plain-value",
                        "extra": {"deep": {"note": [f"x {GH} y", 3]}}, "secrets": ["huggingface"]},
           "model": {"tokenizer": "smollm2-135m", "hf_token": None},
           "eval": {"max_new_tokens": 12}, "url": "https://a/plain-value/b"}
    out = redact(cfg, {"plain-value"})
    assert out == {"launcher": {"note": REDACTED, "header": f"Bearer {REDACTED}", "api_key": REDACTED,
                                "extra": {"deep": {"note": [f"x {REDACTED} y", 3]}}, "secrets": ["huggingface"]},
                   "model": {"tokenizer": "smollm2-135m", "hf_token": None},
                   "eval": {"max_new_tokens": 12}, "url": f"https://a/{REDACTED}/b"}
    assert cfg["launcher"]["note"] == HF  # a copy: the input is untouched


def test_overrides_keep_ordinary_settings_and_lose_secrets():
    given = ["eval.max_new_tokens=12", "model.tokenizer=smollm2-135m", "+launcher.api_key=abc",
             f"+launcher.note={HF}", f"+launcher.header='Bearer {SK}'", "~launcher.token",
             "+launcher.env={HF_TOKEN: xyz12}"]
    assert redact_overrides(given, {"xyz12"}) == [
        "eval.max_new_tokens=12", "model.tokenizer=smollm2-135m", f"+launcher.api_key={REDACTED}",
        f"+launcher.note={REDACTED}", f"+launcher.header='Bearer {REDACTED}'", "~launcher.token",
        f"+launcher.env={{HF_TOKEN: {REDACTED}}}"]


def test_secret_values_and_scrub_files(tmp_path):
    cfg = OmegaConf.create({"launcher": {"env": {"WANDB_API_KEY": "abc123xyz", "HF_TOKEN": "${oc.env:HF_TOKEN}"},
                                         "note": HF}, "model": {"tokenizer": "keep-me"}})
    assert secret_values(cfg) == {"abc123xyz"}  # an interpolation names a secret, it is not one
    f = tmp_path / "overrides.yaml"
    f.write_text(f"- launcher.env.WANDB_API_KEY=abc123xyz\n- +launcher.note={HF}\n- model.tokenizer=keep-me\n")
    scrub_files([f, tmp_path / "absent.yaml"], secret_values(cfg))
    assert f.read_text() == (f"- launcher.env.WANDB_API_KEY={REDACTED}\n- +launcher.note={REDACTED}\n"
                             "- model.tokenizer=keep-me\n")
    assert [p.name for p in tmp_path.iterdir()] == ["overrides.yaml"]  # no temporary file left


def test_log_filter_redacts_hydra_style_override_lines():
    record = logging.LogRecord("hydra", logging.INFO, __file__, 1, "\t#%d : %s", (0, " ".join([
        "model=tiny", "+launcher.api_key=plain-value", f"+launcher.note={HF}", "eval.max_new_tokens=12",
        "+launcher.hf_token=${oc.env:HF_TOKEN}"])), None)
    assert LogFilter().filter(record) is True
    assert record.getMessage() == (f"\t#0 : model=tiny +launcher.api_key={REDACTED} +launcher.note={REDACTED} "
                                   "eval.max_new_tokens=12 +launcher.hf_token=${oc.env:HF_TOKEN}")
