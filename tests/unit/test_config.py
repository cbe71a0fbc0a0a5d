"""Config composition and schema checks: every option composes, typos and bad values are refused."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

from tests.conftest import CONF, TINY, compose
from workbench.core.errors import UserError

GROUPS = ["method", "peft", "model", "backend", "data", "precision", "optim", "eval", "hardware", "launcher"]


def choices(group: str) -> list[str]:
    return sorted(p.stem for p in (Path(CONF) / group).glob("*.yaml"))


def own_values(group: str, name: str) -> dict[str, object]:
    """dotted key -> value of what conf/<group>/<name>.yaml itself sets, at the key it lands on in
    the composed config; left out: its defaults list, interpolations, nulls (filled in by
    validation, e.g. data.recipe from the method), Hydra's own settings and the keys the tests'
    baseline (tests/conftest.py TINY) overrides."""
    from omegaconf import OmegaConf

    path = Path(CONF) / group / f"{name}.yaml"
    node = OmegaConf.load(path)
    node.pop("defaults", None)
    root = node if "@package _global_" in path.read_text() else OmegaConf.create({group: node})
    out = {}

    def walk(n, prefix):
        for k in n:
            key = f"{prefix}{k}"
            if OmegaConf.is_interpolation(n, k):
                continue
            v = n[k]
            if OmegaConf.is_dict(v):
                walk(v, key + ".")
            else:
                out[key] = OmegaConf.to_container(v) if OmegaConf.is_list(v) else v

    walk(root, "")
    baseline = {o.split("=")[0].lstrip("+") for o in TINY}
    return {k: v for k, v in out.items() if v is not None and not k.startswith("hydra.") and k not in baseline}


@pytest.mark.parametrize("group", GROUPS)
def test_every_choice_composes_and_validates(group):
    """Each file composes and validates, and the config holds what the file says: a choice that
    composed to the defaults, or to another file, would fail here."""
    from omegaconf import OmegaConf

    checked = 0
    for name in choices(group):
        cfg = compose([f"{group}={name}"])
        own = own_values(group, name)
        for key, want in own.items():
            got = OmegaConf.select(cfg, key)
            got = OmegaConf.to_container(got) if OmegaConf.is_list(got) else got
            assert got == want, (f"{group}={name}", key, got, want)
        checked += len(own)
    assert checked > 0


def test_method_peft_cross_product_composes():
    for method, peft in itertools.product(choices("method"), choices("peft")):
        cfg = compose([f"method={method}", f"peft={peft}"])
        assert cfg.peft.kind in ("none", "lora", "qlora", "dora")


def test_aliases_set_peft_and_can_be_overridden():
    assert compose(["method=qlora"]).peft.kind == "qlora"
    assert compose(["method=lora"]).peft.kind == "lora"
    assert compose(["method=qlora"]).method.name == "sft"
    assert compose(["method=qlora", "peft=none"]).peft.kind == "none"


def test_model_70b_alias_resolves_to_llama3_70b():
    cfg = compose(["model=70b"])
    assert cfg.model.name == "llama3-70b" and cfg.model.arch.layers == 80


def test_group_files_map_to_the_registries():
    from workbench.backends import registry as backends
    from workbench.methods import registry as methods

    aliases = {"lora": "sft", "qlora": "sft", "simpo": "cpo", "gspo": "grpo", "rloo": "grpo"}
    assert {n for n in choices("method") if n not in aliases} == set(methods.SPECS)
    for name in choices("method"):  # every file composes a registered method; an alias with other options
        assert compose([f"method={name}"], validate=False).method.name == aliases.get(name, name), name
    assert set(choices("backend")) == set(backends.SPECS)


def test_an_unknown_method_is_refused_not_read_as_sft():
    from workbench.methods import registry

    with pytest.raises(UserError, match=r"method.name='nope' is not one of \['cpo', 'distill'"):
        registry.spec("nope")
    with pytest.raises(UserError, match="method.name='nope'"):
        compose(["method.name=nope"])


def test_a_half_made_method_spec_fails_where_it_is_written():
    from dataclasses import dataclass

    from workbench.methods.spec import MethodFacts, MethodSpec

    @dataclass
    class Options:
        name: str = "mine"

    with pytest.raises(TypeError, match="facts is not a MethodFacts"):
        MethodSpec("mine", Options, lambda cfg, ctx: None, facts=None)
    with pytest.raises(TypeError, match="config's name defaults to 'mine'"):
        MethodSpec("other", Options, lambda cfg, ctx: None, facts=MethodFacts(data="sft"))
    with pytest.raises(TypeError, match="facts.data must be one of"):
        MethodSpec("mine", Options, lambda cfg, ctx: None, facts=MethodFacts(data="pairs"))
    with pytest.raises(TypeError, match="states what it generates"):  # the planner would size no rollout
        MethodSpec("mine", Options, lambda cfg, ctx: None, facts=MethodFacts(data="prompts", generates=True))


def test_typo_in_key_is_rejected_by_hydra():
    with pytest.raises(ConfigCompositionException, match="optim.lrr"):
        compose(["optim.lrr=0.1"])


def test_added_unknown_key_is_rejected_by_schema():
    with pytest.raises(UserError, match="optim.lrr"):
        compose(["+optim.lrr=0.1"])


def test_unknown_method_option_is_rejected():
    with pytest.raises(UserError, match="method.los_on"):
        compose(["+method.los_on=all"])


def test_wrong_type_is_rejected():
    # schema-backed groups reject it while Hydra composes; the rest when config.validate runs
    with pytest.raises(ConfigCompositionException, match="optim.lr"):
        compose(["optim.lr=abc"])
    with pytest.raises(UserError, match="train.max_steps"):
        compose(["train.max_steps=many"])


def test_schema_fields_are_overridable_without_plus():
    cfg = compose(["model.loader=hf", "model.attn_implementation=eager", "eval.num_samples=3"])
    assert cfg.model.attn_implementation == "eager" and cfg.eval.num_samples == 3


def test_negative_lr_is_rejected():
    with pytest.raises(UserError, match="optim.lr.*must be > 0"):
        compose(["optim.lr=-1e-4"])


def test_unknown_peft_kind_is_rejected():
    with pytest.raises(UserError, match="peft.kind"):
        compose(["peft.kind=lorax"])
