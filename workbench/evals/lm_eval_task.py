"""lm-evaluation-harness tasks, run in-process on the model being trained (optional extra).

    pip install -e .[eval]                                   # the lm-eval package
    python -m workbench eval.tasks=[lm_eval:arc_easy] eval.lm_eval.limit=200
    python -m workbench eval.tasks=[lm_eval:/path/my_task.yaml]   # a local task YAML (its `task:` name)

The model is handed to lm-eval's Hugging Face wrapper (`HFLM(pretrained=<model>)`) as it is in
memory, adapters active, so nothing is exported or reloaded; tasks come from lm-eval's registry
or from a local YAML (its folder is added as an include path). Metrics land as
`eval/lm_eval/<task>/<metric>` (a filter other than `none` is appended: `exact_match_flexible`),
in metrics.jsonl, results.json and the report. lm-eval may download a registry task's data set
from the hub; a local YAML over local files (`dataset_path: json`, `data_files`) needs nothing.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from workbench.core.errors import UserError, missing_package

PREFIX = "lm_eval:"


def is_lm_eval(task: str) -> bool:
    return task.startswith(PREFIX)


def target(task: str) -> tuple[str, str | None]:
    """(lm-eval task name, include path or None) of `lm_eval:<name | path.yaml>`."""
    spec = task[len(PREFIX):]
    if not spec:
        raise UserError("eval.tasks: 'lm_eval:' needs a task name or a task YAML, e.g. lm_eval:arc_easy")
    if spec.endswith((".yaml", ".yml")):
        f = Path(spec).expanduser()
        if not f.exists():
            raise UserError(f"eval.tasks: {task!r}: task file not found: {f}")
        import yaml

        try:
            body = yaml.safe_load(f.read_text())
        except yaml.YAMLError as exc:
            raise UserError(f"eval.tasks: {f}: not valid YAML ({str(exc).splitlines()[0]})") from None
        name = body.get("task") if isinstance(body, dict) else None
        if not isinstance(name, str):
            raise UserError(f"eval.tasks: {f}: an lm-eval task YAML needs a `task:` name")
        return name, str(f.resolve().parent)
    return spec, None


def check(task: str) -> None:
    """Preflight: lm-eval is installed and a task file exists (registry names are checked by lm-eval)."""
    if importlib.util.find_spec("lm_eval") is None:
        raise missing_package("lm-eval", "eval")
    target(task)


def _metrics(results: dict) -> dict:
    out = {}
    for task, values in (results.get("results") or {}).items():
        for key, value in values.items():
            if "," not in key or "_stderr" in key or not isinstance(value, (int, float)):
                continue
            metric, filt = key.split(",", 1)
            out[f"{task}/{metric}" + ("" if filt == "none" else f"_{filt}")] = float(value)
    return out


def run(ctx, task: str) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    name, include = target(task)
    lm_cfg = ctx.eval_cfg.lm_eval
    model = ctx.model
    # A PEFT model's base model still carries the (active) adapter layers; HFLM wants a
    # PreTrainedModel, which the PeftModel wrapper is not.
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    was = base.training
    base.eval()
    try:
        lm = HFLM(pretrained=base, tokenizer=ctx.tokenizer, batch_size=lm_cfg.batch_size)
        with ctx.autocast_ctx():
            res = simple_evaluate(model=lm, tasks=[name], limit=lm_cfg.limit, num_fewshot=lm_cfg.num_fewshot,
                                  task_manager=TaskManager(include_path=include) if include else TaskManager(),
                                  log_samples=False, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                  fewshot_random_seed=0)
    finally:
        base.train(was)
    if res is None or not res.get("results"):
        raise UserError(f"eval.tasks: {task!r}: lm-eval returned no results (is {name!r} a task it knows?)")
    return _metrics(res)
