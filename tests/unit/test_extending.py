"""The extending guide's two modules (docs/guides/extending.md), taken from the page itself and
registered in process: a method whose spec validates and whose YAML composes, and a model family
whose spec is what the config builder, the GGUF writer, its read-back and the rules read. The
page's blocks themselves (training the method, exporting the family through llama.cpp) run in
tests/unit/test_docs.py.

    python -m pytest -q tests/unit/test_extending.py
"""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import OmegaConf

from tests.conftest import ROOT
from workbench.config.files import CONF_DIR
from workbench.core.errors import UserError
from workbench.families import registry as families
from workbench.methods import registry as methods

GUIDE = ROOT / "docs" / "guides" / "extending.md"


def written_files() -> dict[str, str]:
    """Each `cat > NAME <<'EOF' ... EOF` of the guide: file name -> text."""
    found = re.findall(r"^cat > (\S+) <<'EOF'\n(.*?)^EOF$", GUIDE.read_text(), flags=re.M | re.S)
    return dict(found)


def load(tmp_path, name: str):
    path = tmp_path / name
    path.write_text(written_files()[name])
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def composed(overrides: list[str], searchpath=None):
    extra = [f"hydra.searchpath=[file://{searchpath}]"] if searchpath else []
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="train", overrides=[*extra, *overrides])


def test_the_guide_writes_both_modules():
    assert {"row_mean.py", "ministral.py"} <= set(written_files())


def test_a_registered_method_validates_and_resolves_from_its_spec(tmp_path, monkeypatch):
    from workbench.resolve.resolved import resolve_run
    from workbench.resolve.validate import validate

    module = load(tmp_path, "row_mean.py")
    (tmp_path / "conf" / "method").mkdir(parents=True)
    (tmp_path / "conf" / "method" / "row_mean.yaml").write_text("name: row_mean\nrecipe: arith_sft\n")
    with pytest.raises(UserError, match="row_mean"):  # unregistered: refused by name
        validate(composed(["method=row_mean", "model=tiny"], tmp_path / "conf"))
    monkeypatch.setitem(methods.SPECS, "row_mean", module.SPEC)
    cfg = validate(composed(["method=row_mean", "model=tiny", f"output_dir={tmp_path / 'run'}"], tmp_path / "conf"))
    assert OmegaConf.get_type(cfg.method) is module.Config and cfg.data.recipe == "arith_sft"
    run = resolve_run(cfg)
    assert run.facts.data == "sft" and run.reference == "none" and not run.facts.generates
    with pytest.raises(Exception, match="nope"):  # an option the Config lacks is refused
        validate(composed(["method=row_mean", "model=tiny", "+method.nope=1"], tmp_path / "conf"))


def test_a_registered_family_is_what_every_path_reads(tmp_path, monkeypatch):
    from transformers import MinistralConfig

    from workbench.export import gguf
    from workbench.models.load import hf_config
    from workbench.resolve import rules

    module = load(tmp_path, "ministral.py")
    cfg = composed(["model=tiny", "model.arch.family=ministral", "export.gguf=[f32]"])
    with pytest.raises(UserError, match="gguf-family"):
        rules.check(cfg)
    with pytest.raises(UserError, match="ministral"):
        gguf.check_model("ministral")
    monkeypatch.setitem(families.FAMILIES, "ministral", module.SPEC)
    rules.check(cfg)  # the rule reads the registry
    assert gguf.check_model("ministral").arch == "llama"  # the writer reads the spec
    assert isinstance(hf_config(cfg.model.arch), MinistralConfig)  # the config builder too
    assert "ministral" in families.gguf_model_types() and "ministral" not in families.megatron_model_types()
