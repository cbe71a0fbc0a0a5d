"""README.md of the merged folder (the model card): what it is, how it was made, how it scored."""

from __future__ import annotations

from pathlib import Path

from workbench.core.secrets import redact_overrides, scrub_text, secret_values
from workbench.export import llama_cpp
from workbench.models.load import gguf_metadata


def model_card(run, results: dict, export: dict) -> str:
    """README.md for the merged folder: what it is, how it was made, how it scored."""
    import json as _json

    cfg = run.cfg
    base = cfg.model.hub_id or cfg.model.path or cfg.model.name
    evals = {k: v for k, v in (results.get("eval_end") or {}).items() if isinstance(v, float)}
    before = results.get("eval_start") or {}
    what = ("A reward model: a one-label sequence classifier (score at the last non-padding token), adapters "
            "merged." if export.get("parity", {}).get("merged", {}).get("score_max_abs_diff") is not None else
            "The adapters are merged; generation_config.json stops on the end-of-turn token the model was "
            "trained to emit.")
    lines = ["---", f"base_model: {base}", "library_name: transformers", "tags: [workbench, "
             f"{cfg.method.name}{', ' + run.peft.kind if run.peft.adapter else ''}]", "---", "",
             f"# {Path(cfg.output_dir).name}", "",
             f"Fine-tuned from `{base}` with `method={cfg.method.name}` and `peft={run.peft.kind}` "
             f"(`precision={run.precision.name}`, {cfg.train.max_steps} steps of {cfg.train.micro_batch_size} x "
             f"{cfg.train.grad_accum} per rank). {what}", "",
             "## Evaluation", ""]
    if evals:
        lines += ["| metric | before | after |", "|---|---|---|"]
        lines += [f"| {k} | {before.get(k, float('nan')):.4f} | {v:.4f} |" for k, v in sorted(evals.items())]
    else:
        lines.append("No evaluation was run.")
    lines += ["", "## Export checks", "", "| file | rounding | KL (mean) | greedy equal | stop token | in llama.cpp | passed |",
              "|---|---|---|---|---|---|---|"]
    for name, r in export.get("parity", {}).items():
        if "kl_mean" not in r:  # a reward model's gate compares scores, not next-token distributions
            lines.append(f"| {name} | {r['rounding']} | max score diff {r['score_max_abs_diff']:.2e} | "
                         f"{r['decisions_agree']}/{r['prompts']} pairs ordered alike | - | - | {r['passed']} |")
            continue
        cpp = r.get("llama_cpp") or {}
        in_cpp = llama_cpp.counts(cpp) if cpp.get("ran") else "-"
        ties = r.get("greedy_near_ties") or 0  # parted where the reference's margin is within the rounding
        equal = f"{r['greedy_equal']}/{r['prompts']}" + (f" ({ties} near-tie{'s' if ties > 1 else ''})" if ties else "")
        lines.append(f"| {name} | {r['rounding']} | {r['kl_mean']:.2e} | {equal} | "
                     f"{r['declared_eos']} | {in_cpp} | {r['passed']} |")
    lines += ["", "## How it was made", "", "The run directory holds `config.yaml` (the composed config, secrets "
              "removed) and `manifest.json` (package versions, git commit, data fingerprints). Overrides:", "",
              "```", "python -m workbench " + " ".join(_overrides(cfg)), "```", "",
              f"License: as the base model's ({_license(cfg)}).", ""]
    card = "\n".join(lines) + ("\n<!-- " + _json.dumps({"workbench": True}) + " -->\n")
    return scrub_text(card, secret_values(cfg))  # a model path or eval name can hold a token too


def _overrides(cfg) -> list[str]:
    """The command line's overrides, secrets removed (workbench/core/secrets.py): `eval.max_new_tokens=12`
    and `model.tokenizer=...` stay as given."""

    try:
        from hydra.core.hydra_config import HydraConfig

        items = list(HydraConfig.get().overrides.task)
    except Exception:  # noqa: BLE001 - not under a Hydra run (tests, python API)
        return []
    return redact_overrides(items, secret_values(cfg))


def _license(cfg) -> str:
    return gguf_metadata(cfg.model).get("general.license") or "see the base model's card"
