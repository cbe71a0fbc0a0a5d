"""No secret reaches a run's directory or its console, wherever it was planted.

Each secret below is a made-up value of a real shape or under a real key name. They are planted
in the environment (HF_TOKEN, HUGGING_FACE_HUB_TOKEN, GITHUB_TOKEN, GH_TOKEN, MLFLOW_TRACKING_TOKEN,
AWS_SESSION_TOKEN, WANDB_API_KEY), in the config (secret-looking keys under `launcher`), in the
prompt rows GRPO samples from (token shapes, a URL password, `WANDB_API_KEY=<40 hex>`, and the
environment's and the config's values written without their key) and in exception messages; then
tiny runs go in-process (the runner for samples/grpo.jsonl and samples/episodes.jsonl, the CLI for
the `error:` line, Hydra's files and an unexpected exception's traceback, the watchdog for
stalls/) and every file they wrote and everything they printed is searched: 0 hits. Prompt text
that only looks like a secret (a git sha, `max_new_tokens`, `task-123`) stays as written.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_redaction_everywhere.py
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import traceback

import pytest

from tests.conftest import TINY, train
from workbench.core.secrets import REDACTED, ScrubbedError


def _hex40(seed: str) -> str:
    return hashlib.sha1(seed.encode()).hexdigest()


# the environment
ENV = {"HF_TOKEN": "hf_" + "Qe8" * 10, "HUGGING_FACE_HUB_TOKEN": "hubEnvValue-5v7b9n",
       "GITHUB_TOKEN": "ghEnvValue-2k4m6p", "GH_TOKEN": "ghCliValue-8r1t3y",
       "MLFLOW_TRACKING_TOKEN": "mlflowEnvValue-4d6f8h", "AWS_SESSION_TOKEN": "FwoGZXIvEnvSession-3s5u",
       "WANDB_API_KEY": _hex40("wandb key in the environment")}
# the config: values under secret-looking keys, a URL password, token shapes under innocent keys
CFG = {"private_key": "cfgPrivateValue-7w9e", "aws_session_token": "cfgSessionValue-1q3z",
       "tracker_token": "cfgTrackerValue-6x8c", "HUGGING_FACE_HUB_TOKEN": "cfgHubValue-2v4b",
       "url_password": "cfgUrlPassword-5n7m", "bearer": "cfgBearerValue-9a1s",
       "wandb": _hex40("wandb key in the config"), "glpat": "glpat-" + "Cf4_" * 5, "asia": "ASIA" + "CFG0" * 4}
CONFIG_OVERRIDES = [f"+launcher.private_key={CFG['private_key']}",
                    f"+launcher.aws_session_token={CFG['aws_session_token']}",
                    f"+launcher.tracker_token={CFG['tracker_token']}",
                    f"+launcher.HUGGING_FACE_HUB_TOKEN={CFG['HUGGING_FACE_HUB_TOKEN']}",
                    f"+launcher.endpoint='https://bob:{CFG['url_password']}@example.com/x'",
                    f"+launcher.Authorization='Bearer {CFG['bearer']}'",
                    f"+launcher.env.WANDB_API_KEY={CFG['wandb']}",
                    f"+launcher.note={CFG['glpat']}", f"+launcher.aws_key_id={CFG['asia']}"]
# the data: shapes, a URL password, a W&B key after its name, and earlier values without their key
DATA = {"hf": "hf_" + "Dt5" * 8, "glpat": "glpat-" + "Dt7x" * 5, "asia": "ASIA" + "DAT1" * 4,
        "url_password": "dataUrlPassword-3j5k", "wandb": _hex40("wandb key in the data")}
GIT_SHA = _hex40("a commit")  # 40 hex like a W&B key, but no key says it is one: kept
KEPT = [GIT_SHA, "max_new_tokens", "tokenizer", "task-123", "disk-abc"]
SECRETS = sorted({*ENV.values(), *CFG.values(), *DATA.values()})


def _prompt(a: int, b: int) -> str:
    return (f"What is {a} + {b}? {DATA['hf']} {DATA['glpat']} {DATA['asia']} "
            f"https://amy:{DATA['url_password']}@data.example.com/p WANDB_API_KEY={DATA['wandb']} "
            f"{ENV['HUGGING_FACE_HUB_TOKEN']} {CFG['private_key']} commit {GIT_SHA} {' '.join(KEPT[1:])}")


def _prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": _prompt(a, a + 1)}],
                                        "answer": str(2 * a + 1)}) + "\n" for a in range(10, 26)))
    return path


def lengthy(completions, **_) -> list[float]:
    """A reward with spread on the tiny model's random text."""
    return [len(c) / 50.0 for c in completions]


def leaky(completions, **_) -> list[float]:
    """A user's reward function whose error message quotes secrets."""
    raise ValueError(f"could not reach https://eve:{DATA['url_password']}@api.example.com "
                     f"with {ENV['GITHUB_TOKEN']} and WANDB_API_KEY={DATA['wandb']}")


@pytest.fixture
def planted(monkeypatch):
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)


def _hits(text: str) -> list[str]:
    return [s for s in SECRETS if s in text]


def _file_hits(folder) -> list[str]:
    files = [p for p in folder.rglob("*") if p.is_file()]
    assert files, folder
    return [f"{s} in {p.relative_to(folder)}" for p in files for s in SECRETS if s.encode() in p.read_bytes()]


def _kept_and_redacted(text: str) -> None:
    assert REDACTED in text
    for word in KEPT:
        assert word in text, word


RUN = ["method=grpo", "train.max_steps=1", "method.dynamic_sampling=false", "method.log_completions=64",
       *CONFIG_OVERRIDES]


def test_a_grpo_run_writes_and_prints_no_secret(tmp_path, planted, capfd):
    out = tmp_path / "run"
    train([*RUN, 'reward.functions=["tests.unit.test_redaction_everywhere:lengthy"]',
           f"data.path={_prompts(tmp_path)}"], out)
    printed = capfd.readouterr()
    assert _hits(printed.out + printed.err) == []
    assert _file_hits(out) == []
    samples = (out / "samples" / "grpo.jsonl").read_text()
    _kept_and_redacted(samples)
    assert f"https://amy:{REDACTED}@data.example.com/p" in samples and f"WANDB_API_KEY={REDACTED}" in samples


def test_episodes_hold_no_secret(tmp_path, planted, capfd):
    out = tmp_path / "run"
    train(["method=grpo", "env=calc", "env.max_new_tokens=8", "method.num_generations=4", "train.micro_batch_size=8",
           "method.dynamic_sampling=false", "train.max_steps=1", "method.log_completions=64",
           'reward.functions=["tests.unit.test_redaction_everywhere:lengthy"]', *CONFIG_OVERRIDES,
           f"data.path={_prompts(tmp_path)}"], out)
    printed = capfd.readouterr()
    assert _hits(printed.out + printed.err) == []
    assert _file_hits(out) == []
    _kept_and_redacted((out / "samples" / "episodes.jsonl").read_text())


@pytest.fixture
def cli_main(monkeypatch):
    """`python -m workbench <argv>` in this process; Hydra's global state and logging put back after."""
    from hydra.core.global_hydra import GlobalHydra

    from workbench import cli

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level

    def main(argv: list[str]):
        monkeypatch.setattr(sys, "argv", ["workbench", *argv])
        with pytest.raises((SystemExit, ScrubbedError)) as info:  # Hydra re-raises under a tracer (coverage)
            cli.main()
        return info.value

    yield main
    for h in root.handlers:
        if h not in handlers:
            h.close()
    root.handlers[:], root.level = handlers, level
    GlobalHydra.instance().clear()


def test_the_error_line_of_a_failing_reward_holds_no_secret(tmp_path, planted, capfd, cli_main):
    out = tmp_path / "run"
    exc = cli_main([*TINY, *RUN, 'reward.functions=["tests.unit.test_redaction_everywhere:leaky"]',
                    f"data.path={_prompts(tmp_path)}", f"output_dir={out}"])
    printed = capfd.readouterr()
    assert isinstance(exc, SystemExit) and exc.code == 2, printed.err[-2000:]  # a UserError
    assert "error: reward function 'tests.unit.test_redaction_everywhere:leaky' raised" in printed.err
    assert f"https://eve:{REDACTED}@api.example.com" in printed.err and f"WANDB_API_KEY={REDACTED}" in printed.err
    assert _hits(printed.out + printed.err) == []
    assert (out / ".hydra" / "overrides.yaml").exists()
    assert _file_hits(out) == []


def test_an_unexpected_exception_is_printed_without_its_secrets(tmp_path, planted, capfd, cli_main, monkeypatch):
    from workbench import cli

    def broken(cfg):
        try:
            raise KeyError(f"{ENV['HF_TOKEN']} {CFG['private_key']}")
        except KeyError as exc:
            raise RuntimeError(f"failed with {CFG['tracker_token']} at https://x:{DATA['url_password']}@h/ "
                               f"{ENV['WANDB_API_KEY']}") from exc

    monkeypatch.setattr(cli, "run_job", broken)
    out = tmp_path / "run"
    exc = cli_main([*TINY, *CONFIG_OVERRIDES, f"output_dir={out}"])
    printed = capfd.readouterr()
    shown = printed.out + printed.err
    if isinstance(exc, ScrubbedError):  # Hydra raised it instead of printing it: what Python would print
        shown += "".join(traceback.format_exception(exc))
    else:
        assert exc.code == 1 and "Error executing job with overrides" in shown, shown[-2000:]
    # the traceback is still there, with both exceptions and the frame that raised them
    assert "RuntimeError: failed with" in shown and "KeyError" in shown and "in broken" in shown, shown[-2000:]
    assert REDACTED in shown
    assert _hits(shown) == []
    assert _file_hits(out) == []


def test_the_watchdog_files_hold_no_secret(tmp_path, planted):
    """A rank's failure (failure.json, its traceback file, the line for the other ranks), a stall
    verdict (stall.json) and a stack file's note, with a store standing in for the process group's."""
    from workbench.guard.watchdog import Watchdog, save_traceback

    class Store:
        def __init__(self):
            self.kv = {}

        def compare_set(self, key, expected, desired):
            self.kv.setdefault(key, desired)
            return self.kv[key].encode()

    message = (f"{ENV['HF_TOKEN']} {ENV['AWS_SESSION_TOKEN']} {DATA['glpat']} {DATA['asia']} "
               f"https://u:{DATA['url_password']}@h/ WANDB_API_KEY={DATA['wandb']}")
    dog = Watchdog(tmp_path, 0, 2)
    dog.store = Store()
    try:
        raise RuntimeError(message)
    except RuntimeError as exc:
        dog.fail(exc)
    try:  # the CLI passes the config's secret values (the watchdog has no config)
        raise RuntimeError(f"{message} {CFG['private_key']}")
    except RuntimeError as exc:
        save_traceback(tmp_path, 1, exc, {CFG["private_key"]})
    dog._record({"ranks": [1], "reason": message, "message": f"rank 1 stalled: {message}"})
    dog._write_stacks(note=f"a collective failed here: {message}")
    stalls = tmp_path / "stalls"
    assert {p.name for p in stalls.iterdir()} >= {"failure.json", "traceback-rank0.txt", "traceback-rank1.txt",
                                                  "stall.json", "rank-0.txt"}
    assert _file_hits(tmp_path) == []
    assert _hits(dog.store.kv["error"]) == [] and REDACTED in dog.store.kv["error"]
    assert "RuntimeError" in (stalls / "traceback-rank0.txt").read_text()
