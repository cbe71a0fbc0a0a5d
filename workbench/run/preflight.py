"""Preflight: the checks every run makes before anything heavy, and alone with dry_run=true.

In order, cheapest first, all before any weights load:
1. the resolved run (workbench/resolve/resolved.py), which checks the rule table (workbench/resolve/rules.py:
   method x peft x backend x precision x hardware, GPU-only options, backend options); then what
   the run would otherwise find only after loading weights: GRPO's reward functions import (the
   same `rewards.resolve` the method calls), the eval tasks exist and their hooks import, and
   train.keep_best names a metric those tasks report (not merely at the first evaluation);
2. the model on the meta device (one block, exact parameter counts; adapter targets exist);
3. the plan (workbench/plan/): a run that cannot fit the configured hardware is refused here,
   with where it would fit, how many devices it needs, and time and cost;
4. where the weights come from (nothing is downloaded);
5. one data sample rendered through the chat template and loss mask (tokenizer only);
6. on an existing run directory, the checkpoint it would resume (workbench/checkpoints/resume.py): the
   same model, adapter and tokenizer, and the batch at this layout (dry_run prints that plan).

With dry_run=true, problems of *this machine* (no GPU, weights not local, a GPU-only package
missing) are warnings, so a laptop can plan a cluster run.

    python -m workbench dry_run=true method=dpo model=70b hardware=8xh100
"""

from __future__ import annotations

import sys

from omegaconf import OmegaConf

from workbench.checkpoints import keep_best, resume, resume_changes
from workbench.core.errors import UserError
from workbench.data import chat, formats
from workbench.data.preference import preference_row
from workbench.data.readers import iter_rows
from workbench.data.recipes import load_recipe
from workbench.data.unpaired import unpaired_rows
from workbench.envs.registry import load as load_env
from workbench.evals import hooks
from workbench.methods import registry
from workbench.models import import_check
from workbench.models.load import import_report, load_tokenizer, locate
from workbench.models.unsloth_loader import check_versions
from workbench.plan.counts import count, probe
from workbench.plan.make import make_plan, refusal
from workbench.resolve import no_effect, rules
from workbench.resolve.resolved import resolve_run
from workbench.rollout import rewards
from workbench.train.distributed import is_main_process


def _machine_checks_apply(cfg) -> bool:
    """True when the run would execute on this machine (not merely be planned or sent away)."""
    return rules.runs_here(cfg) and not cfg.dry_run


def tokenizer(cfg) -> tuple:
    """The run's tokenizer and its chat contract, loaded once: preflight renders the first row
    with them and hands them to the runner (facts["tokenizer"])."""

    tok = load_tokenizer(cfg.model)
    return tok, chat.setup_tokenizer(tok, cfg.data.chat_template)


def data_sample(cfg, tokenizer, contract) -> dict:
    """Render the first row of the run's data through the template and the loss mask."""

    src = load_recipe(cfg.data.recipe).sources[0]
    try:
        where, row = next(iter(iter_rows(src, src.columns or None, src.split)))
    except StopIteration:
        raise UserError(f"{src.label}: the data source is empty") from None
    shape = registry.spec(cfg.method.name).facts.data
    if shape == "preference":

        prompt, chosen, _rejected = preference_row(row, where)
        ids, labels = chat.tokenize_chat(tokenizer, prompt + chosen, contract)
    elif shape == "unpaired":  # (prompt, completion, label) rows, or pairs split into two such rows

        prompt, completion, _label = unpaired_rows(row, where)[0]
        ids, labels = chat.tokenize_chat(tokenizer, prompt + completion, contract)
    elif shape == "prompts" or "prompt" in row and "completion" not in row:
        prompt = row.get("prompt")
        msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt or [])
        if not msgs:
            raise UserError(f"{where}: no prompt in the first row (keys: {sorted(row)})")
        formats.check_messages(msgs, "prompt", where)  # before the template: file:line, not a Jinja error
        ids = chat.prompt_ids(tokenizer, msgs)
        return {"where": where, "tokens": len(ids), "trained": 0, "kind": "prompt"}
    else:
        fmt = src.format if src.format != "auto" else formats.detect_format(row, where)
        msgs = formats.to_messages(row, fmt, where)
        if isinstance(msgs, str):  # plain text: every token trains
            ids = tokenizer(msgs, add_special_tokens=False)["input_ids"]
            return {"where": where, "tokens": len(ids), "trained": len(ids), "kind": "text"}
        ids, labels = chat.tokenize_chat(tokenizer, msgs, contract,
                                            registry.spec(cfg.method.name).loss_on(cfg.method))
    trained = sum(1 for x in labels[1:] if x != chat.IGNORE)
    if trained == 0:
        raise UserError(f"{where}: after the chat template and loss mask the first sample trains no token; "
                        "check the row's assistant turn, data.chat_template and method.loss_on")
    return {"where": where, "tokens": len(ids), "trained": trained, "kind": "chat"}


def check(cfg, env: rules.Env | None = None) -> dict:
    """Raise UserError on the first problem; return facts found on the way (and the plan)."""

    here = _machine_checks_apply(cfg)
    run = resolve_run(cfg, planning=not here, env=env)  # the rule table; machine rules warn when planning
    warnings = list(run.warnings)
    if here and cfg.model.loader == "unsloth":

        check_versions()
    if registry.spec(cfg.method.name).facts.data == "prompts":  # GRPO scores rollouts with cfg.reward
        fns = rewards.resolve(cfg.reward)  # as the method does when it is built: built-ins known, user functions import
        if here:  # a reward service that is down stops a run here, before anything loads (a dry run plans without it)
            rewards.check_services(fns)
    hooks.check_tasks(cfg.eval.tasks, cfg)  # names, user hooks importable, held-out data for loss/preference/reward
    if cfg.get("env") is not None:  # env=<name>: a known environment with valid tool schemas (workbench/envs/)

        load_env(cfg.env)
    # train.keep_best names a metric the tasks report; evaluations fall on checkpoints
    keep_best.check(cfg, hooks.metrics(cfg.eval.tasks, cfg))
    for line in no_effect.warnings(cfg):  # accepted, not read: a dry run lists it, a run says it now
        if cfg.dry_run:
            warnings.append(line)
        elif is_main_process():
            print(f"warning: {line}", file=sys.stderr, flush=True)

    counts = count(probe(cfg.model), cfg.model.arch, cfg.peft)  # meta device; checks adapter targets
    # A run that fits here needs no other profile; the rest of the catalog is read for dry runs
    # and for a refusal, which names where the run would fit.
    plan = make_plan(cfg, counts, others=cfg.dry_run)
    enforce = OmegaConf.select(cfg, "plan.enforce", default=True)
    if enforce and not cfg.dry_run and not plan["here"]["fits"] and plan["here"]["usable_gb"] > 0:
        raise UserError(refusal(make_plan(cfg, counts)))

    facts = {"n_params": counts.total, "n_trainable": plan["params"]["trainable"], "plan": plan,
             "warnings": warnings, "resolved": run.summary(), "run": run}
    try:
        facts["model_source"] = locate(cfg.model).kind
    except UserError as exc:
        if not cfg.dry_run:
            raise
        facts["model_source"] = "not found here"
        warnings.append(str(exc))
    if facts["model_source"] in ("tiny", "local", "hf_cache", "converted", "gguf") or cfg.model.tokenizer:
        try:
            facts["tokenizer"] = tokenizer(cfg)
            facts["sample"] = data_sample(cfg, *facts["tokenizer"])
        except UserError as exc:
            if not cfg.dry_run or "weights not found" not in str(exc):
                raise
            warnings.append(str(exc))
    else:
        warnings.append(f"data sample not rendered: model={cfg.model.name}'s tokenizer is not on this machine")
    checked = import_report(cfg.model)  # a converted GGUF: what its import check compared, and the figures
    if checked is not None:
        facts["import_check"] = checked
        if is_main_process():
            print(f"model: {import_check.line(checked)}", file=sys.stderr, flush=True)

    rec = resume.record_of(cfg.output_dir, cfg.train.resume)
    if rec is not None and "tokenizer" in facts:
        resume.check_identity(rec, resume.identity(run.cfg, run, *facts["tokenizer"]))
    resume_changes.check(rec, run.cfg)  # one run directory, one config (workbench/checkpoints/resume_changes.py)
    facts["resume"] = resume.plan_line(rec, run.cfg, run)
    return facts

