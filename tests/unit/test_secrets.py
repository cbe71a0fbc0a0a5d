"""The one redaction rule (workbench/core/secrets.py): a value is secret when its key looks
secret or when it is token-shaped, wherever it sits; ordinary settings that mention tokens stay.
End-to-end runs through the CLI are in tests/integration/test_hydra_secrets.py."""

from __future__ import annotations

import json
import logging
import traceback

from omegaconf import OmegaConf

from workbench.core.secrets import (
    REDACTED,
    LogFilter,
    ScrubbedError,
    env_secret_values,
    redact,
    redact_overrides,
    scrub_exception,
    scrub_files,
    scrub_text,
    secret_key,
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


def test_key_names_of_the_usual_services_are_secret_and_settings_are_not():
    for key in ("HUGGING_FACE_HUB_TOKEN", "GITHUB_TOKEN", "GH_TOKEN", "MLFLOW_TRACKING_TOKEN", "aws_session_token",
                "AWS_SECRET_ACCESS_KEY", "private_key", "Authorization", "proxy-authorization", "tracker_token",
                "WANDB_API_KEY", "x-api-key", "MODAL_TOKEN_SECRET", "hub_token", "oauth_token"):
        assert secret_key(key), key
    for key in ("tokenizer", "max_new_tokens", "pad_token", "eos_token", "experts_per_token", "flops_per_token",
                "git_sha", "commit", "task_id", "AWS_ACCESS_KEY_ID", "TOKENIZERS_PARALLELISM", "HF_TOKEN_PATH",
                "keys", "author"):
        assert not secret_key(key), key
    cfg = {"env": {"HUGGING_FACE_HUB_TOKEN": "a1", "GITHUB_TOKEN": "a2", "GH_TOKEN": "a3",
                   "MLFLOW_TRACKING_TOKEN": "a4"},
           "aws": {"aws_session_token": "a5", "private_key": "a6"}, "headers": {"Authorization": "Basic a7"},
           "model": {"tokenizer": "smollm2-135m", "pad_token": "<|endoftext|>"}}
    assert redact(cfg) == {"env": {k: REDACTED for k in cfg["env"]},
                           "aws": {"aws_session_token": REDACTED, "private_key": REDACTED},
                           "headers": {"Authorization": REDACTED}, "model": cfg["model"]}


GLPAT = "glpat-" + "x7Y_" * 5
ASIA = "ASIA" + "Q2W3" * 4
WANDB = "0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c"  # 40 hex: a W&B key, or a git sha
SHA = "9b2c4e6f8a0b1c2d3e4f5a6b7c8d9e0f1a2b3c4d"


def test_new_token_shapes_and_url_passwords():
    for text, want in [
        (f"token {GLPAT}.", f"token {REDACTED}."),
        (f"key id {ASIA} and AKIA" + "IOSFODNN7EXAMPLE", f"key id {REDACTED} and {REDACTED}"),
        ("https://bob:s3cr3t-pw@example.com/x.git", f"https://bob:{REDACTED}@example.com/x.git"),
        ("git+https://bob:p@ss:w0rd@example.com", f"git+https://bob:{REDACTED}@example.com"),  # `@` in the password
        ("redis://:pw-only-1@cache:6379/0", f"redis://:{REDACTED}@cache:6379/0"),
        (f"url=https://u:{GH}@github.com/o/r", f"url=https://u:{REDACTED}@github.com/o/r"),
        ('{"url": "postgres://app:hunter2@db/x", "n": 1}', f'{{"url": "postgres://app:{REDACTED}@db/x", "n": 1}}'),
    ]:
        assert scrub_text(text) == want, text
    # a user without a password, a port, an `@` in the path, a task id: as they are
    for plain in ("ssh://git@github.com:22/o/r.git", "https://host:8080/path@v2", "git@github.com:o/r.git",
                  "glpat-short", "ASIA-pacific", "task-123", "disk-abc", "max_new_tokens=12 tokenizer=x"):
        assert scrub_text(plain) == plain


def test_a_40_hex_value_is_secret_only_after_a_secret_key():
    for text, want in [
        (f"WANDB_API_KEY={WANDB}", f"WANDB_API_KEY={REDACTED}"),
        (f"export WANDB_API_KEY='{WANDB}'", f"export WANDB_API_KEY='{REDACTED}'"),
        (f'{{"api_key": "{WANDB}"}}', f'{{"api_key": "{REDACTED}"}}'),
        (f"os.environ['WANDB_API_KEY'] = '{WANDB}'", f"os.environ['WANDB_API_KEY'] = '{REDACTED}'"),
        (f"+launcher.env.WANDB_API_KEY={WANDB}", f"+launcher.env.WANDB_API_KEY={REDACTED}"),
        (f"Authorization: Bearer {WANDB}", f"Authorization: Bearer {REDACTED}"),
        ("Authorization: Basic dXNlcjpwYXNz", f"Authorization: Basic {REDACTED}"),  # any shape after Authorization
    ]:
        assert scrub_text(text) == want, text
    manifest = json.dumps({"git_sha": SHA, "git": {"commit": SHA, "dirty": False}, "data": {"fingerprint": WANDB},
                           "model": {"tokenizer": "smollm2-135m"}, "eval": {"max_new_tokens": 12}}, indent=1)
    assert scrub_text(manifest) == manifest
    assert redact(json.loads(manifest)) == json.loads(manifest)
    for plain in (f"commit {SHA}", f"HEAD is {WANDB}", f"token_count: {SHA}", f"api_key={SHA[:39]}"):
        assert scrub_text(plain) == plain


def test_values_of_secret_environment_variables_are_scrubbed_without_their_key(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "plain-env-value-1")  # not token-shaped: only the environment says it is secret
    monkeypatch.setenv("WANDB_API_KEY", WANDB)
    monkeypatch.setenv("GH_TOKEN", "abc")  # too short to replace on its own
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false-but-long")  # not a secret name
    assert {"plain-env-value-1", WANDB} <= env_secret_values()
    assert not {"abc", "false-but-long"} & env_secret_values()
    text = f"sent plain-env-value-1 and {WANDB} to abc, false-but-long"
    assert scrub_text(text) == f"sent {REDACTED} and {REDACTED} to abc, false-but-long"
    assert redact({"note": [text]}) == {"note": [scrub_text(text)]}
    record = logging.LogRecord("workbench", logging.INFO, __file__, 1, "token %s", ("plain-env-value-1",), None)
    LogFilter().filter(record)
    assert record.getMessage() == f"token {REDACTED}"
    monkeypatch.delenv("HF_TOKEN")  # the environment is read again when it changes
    assert scrub_text("plain-env-value-1") == "plain-env-value-1"


def test_a_secret_value_holding_a_token_shape_goes_whole():
    value = f"prefix-{HF}-suffix"
    assert scrub_text(f"x {value} y", {value}) == f"x {REDACTED} y"


def test_an_exception_is_replaced_by_a_scrubbed_stand_in_with_its_frames_and_chain():
    def fail():
        try:
            raise KeyError(f"inner {HF}")
        except KeyError as exc:
            raise RuntimeError("outer plain-cfg-value") from exc

    try:
        fail()
    except RuntimeError as exc:
        original = exc
    shown = scrub_exception(original, {"plain-cfg-value"})
    text = "".join(traceback.format_exception(shown))
    assert isinstance(shown, ScrubbedError) and HF not in text and "plain-cfg-value" not in text
    # both exceptions, their frames and source lines, scrubbed
    assert "RuntimeError: outer <redacted>" in text and f"KeyError: 'inner {REDACTED}'" in text
    assert text.count("in fail") == 2 and 'raise RuntimeError("outer <redacted>") from exc' in text
    plain = ValueError("nothing secret")
    assert scrub_exception(plain) is plain
