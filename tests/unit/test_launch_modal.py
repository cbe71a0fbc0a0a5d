"""launcher=modal, offline: the Modal App, Function and Image objects are built and inspected
(GPU spec, image steps, volume, retries, secrets by name); nothing is sent to Modal.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_launch_modal.py
"""

from __future__ import annotations

import sys

import pytest

from tests.conftest import ROOT, compose
from workbench.core.errors import UserError

pytest.importorskip("modal")

H100x8 = ["launcher=modal", "hardware.device=cuda", "hardware.accelerator=H100", "hardware.procs=8"]


def _impl(obj):
    """The implementation object behind modal's synchronous wrapper."""
    from modal._utils.async_utils import synchronizer

    return synchronizer._translate_in(obj)


def _closure(fn) -> dict:
    return dict(zip(fn.__code__.co_freevars, [c.cell_contents for c in fn.__closure__ or ()]))


def image_steps(image) -> tuple[list[str], dict[str, str]]:
    """Dockerfile commands and context files of an image chain, base first."""
    commands, files = [], {}

    def walk(im):
        for dep in im._deps_() if im._deps_ else ():
            if type(dep).__name__ == "_Image":
                walk(dep)
        build = _closure(im._load).get("dockerfile_function")
        if build:
            spec = build("2025.06")
            commands.extend(spec.commands)
            files.update(spec.context_files)

    walk(_impl(image))
    return commands, files


def test_function_spec_gpu_volume_secrets_retries(tmp_path):
    from workbench.launch import modal_app

    cfg = compose([*H100x8, "launcher.secrets=[huggingface,wandb]", "launcher.retries=3"], tmp_path)
    app, fn = modal_app.build(cfg)
    assert app.name == "workbench"
    spec = fn._spec_
    assert spec.gpus == "H100:8"
    assert set(spec.volumes) == {"/vol"}
    assert "workbench" in repr(spec.volumes["/vol"])
    assert [repr(s) for s in spec.secrets] == ["modal.Secret.from_name('huggingface')",
                                               "modal.Secret.from_name('wandb')"]
    loaded = _closure(_impl(fn)._load)
    assert loaded["retry_policy"].retries == 3 and loaded["retry_policy"].initial_delay_ms == 10000
    assert loaded["timeout"] == 1440 * 60
    assert (fn._raw_f_.__module__, fn._raw_f_.__qualname__) == ("workbench.launch.modal_app", "run_remote")


def test_image_installs_the_lock_then_the_checkout(tmp_path):
    from workbench.launch import modal_app

    _, fn = modal_app.build(compose(H100x8, tmp_path))
    commands, files = image_steps(fn._spec_.image)
    pip = [c for c in commands if "pip install" in c and "-r" in c]
    assert pip and "--no-deps" in pip[-1]
    # the exact lock file of this checkout is what gets installed
    assert list(files.values()) == [str(ROOT / "constraints.txt")]
    env = "\n".join(c for c in commands if c.startswith("ENV"))
    assert "HF_HOME=/vol/hf-cache" in env and "WORKBENCH_CACHE=/vol/workbench-cache" in env
    assert any(c.startswith("WORKDIR /root/project") for c in commands)
    # the checkout is mounted at run time, not copied into a layer: code changes do not rebuild the deps
    assert not any(c.startswith("COPY") and "project" in c for c in commands) and fn._spec_.mounts


def test_gpu_spec_from_hardware_and_overrides(tmp_path):
    from workbench.launch import modal_app

    lc = modal_app.Config()
    assert modal_app.gpu_spec(compose(["hardware.device=cuda", "hardware.accelerator=A100-80GB",
                                       "hardware.procs=4"], tmp_path), lc) == "A100-80GB:4"
    assert modal_app.gpu_spec(compose([], tmp_path), lc) is None  # the CPU profile: a CPU container
    assert modal_app.gpu_spec(compose([], tmp_path), modal_app.Config(gpu="L40S:2")) == "L40S:2"
    with pytest.raises(UserError, match="has no Modal GPU type; set launcher.gpu"):
        modal_app.gpu_spec(compose(["hardware.device=cuda", "hardware.accelerator=MI300X"], tmp_path), lc)
    with pytest.raises(UserError, match="hardware.nodes=2"):
        modal_app.gpu_spec(compose([*H100x8, "hardware.nodes=2"], tmp_path), lc)


def test_bad_launcher_field_names_it(tmp_path):
    from workbench.launch import modal_app

    with pytest.raises(UserError, match="launcher.retries"):
        modal_app.build(compose([*H100x8, "launcher.retries=many"], tmp_path))


def test_missing_modal_gives_install_hint(tmp_path, monkeypatch):
    from workbench.launch import modal_app

    monkeypatch.setitem(sys.modules, "modal", None)
    with pytest.raises(UserError, match=r"'modal' is not installed.*pip install -e '\.\[modal\]'"):
        modal_app.launch(compose(H100x8, tmp_path))


def test_missing_ray_and_submitit_give_install_hints(tmp_path, monkeypatch):
    from workbench.launch import ray_train, slurm

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(UserError, match=r"'ray' is not installed.*pip install -e '\.\[ray\]'"):
        ray_train.launch(compose(["launcher=ray"], tmp_path))
    monkeypatch.setitem(sys.modules, "submitit", None)
    for var in ("SUBMITIT_EXECUTOR", "SLURM_JOB_ID", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(UserError, match=r"'submitit' is not installed.*pip install -e '\.\[slurm\]'"):
        slurm.launch(compose(["launcher.name=slurm"], tmp_path))


@pytest.mark.parametrize("name,package", [("ray", "ray"), ("modal", "modal"), ("runpod", "runpod")])
def test_dispatch_reaches_each_launcher(tmp_path, monkeypatch, name, package):
    """launcher=<name> goes through launch.dispatch to its module (import blocked: the hint)."""
    from workbench.launch.dispatch import LAUNCHERS, dispatch

    assert name in LAUNCHERS
    monkeypatch.setitem(sys.modules, package, None)
    with pytest.raises(UserError, match=rf"'{package}' is not installed"):
        dispatch(compose([f"launcher={name}"], tmp_path))
