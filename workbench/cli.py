"""Command line: `python -m workbench [group=choice ...] [key=value ...]` (Hydra).

    python -m workbench                         # LoRA SFT of SmolLM2-135M on CPU (the default)
    python -m workbench --cfg job               # print the composed config and exit
    python -m workbench -m optim.lr=1e-4,3e-4   # multirun sweep
    python -m workbench dry_run=true            # preflight only: no weights loaded

Exit status: 0 done; 2 a mistake in config, data or environment (one `error:` line, before any
weights load), a checkpoint that could not be written (disk full) or more NaN/Inf steps than
`train.max_bad_steps`; 3 a rank stalled or another rank failed (the watchdog,
workbench/train/watchdog.py: stacks in `<run>/stalls/`); 75 preempted by SIGTERM/SIGINT after
writing a checkpoint (relaunch with the same output_dir to continue); 143/130 a second
SIGTERM/SIGINT, at once (workbench/train/faults.py).
Secrets given on the command line are redacted from Hydra's own copies in `<run>/.hydra/` too,
by the rule of workbench/core/secrets.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from workbench.config.files import CONF_DIR
from workbench.config.run import needs_bitsandbytes
from workbench.config.validate import validate
from workbench.core import startup
from workbench.core.errors import UserError
from workbench.core.imports import import_without_incidentals, skip_bitsandbytes
from workbench.core.secrets import redact_overrides, scrub_exception, scrub_files, scrub_text, secret_values


def _redact_hydra_files(cfg: DictConfig) -> None:
    """Hydra writes the composed config and the raw command line into `<run>/.hydra/` (and a
    multirun's `multirun.yaml`) before the job starts, with the command line verbatim: the rule
    of workbench/core/secrets.py is applied to them here, as the run applies it to its own files."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return
    hc = HydraConfig.get()
    files = []
    if hc.output_subdir:
        folder = Path(hc.runtime.output_dir) / hc.output_subdir
        files += [folder / "config.yaml", folder / "hydra.yaml", folder / "overrides.yaml"]
    if hc.mode == RunMode.MULTIRUN:
        files.append(Path(hc.sweep.dir) / "multirun.yaml")
    scrub_files(files, secret_values(cfg))


class RedactSecrets(Callback):
    """Hydra callback (conf/train.yaml lists it before `sweep_summary`: Hydra calls multirun-end
    callbacks in reverse order, so this one runs after the summary has written). Scrubs what
    Hydra writes beside each job (`.hydra/`, the sweep dir's `multirun.yaml`) and, at the end,
    `sweep_summary.{md,csv}`, which copy the command line (their sources, `sweep_job.json` and
    `.hydra/overrides.yaml`, are already clean; this keeps the summary clean whatever it copies)."""

    def on_job_start(self, config: DictConfig, **kwargs) -> None:
        _redact_hydra_files(config)

    def on_job_end(self, config: DictConfig, job_return, **kwargs) -> None:
        # Hydra prints a failed job's overrides verbatim ("Error executing job with overrides: ...")
        job_return.overrides = redact_overrides(job_return.overrides or [], secret_values(config))

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep = Path(str(config.hydra.sweep.dir))
        scrub_files([sweep / n for n in ("multirun.yaml", "sweep_summary.md", "sweep_summary.csv",
                                         "optimization_results.yaml")],  # the Optuna sweeper's best params
                    secret_values(config))


def run_job(cfg: DictConfig) -> dict | None:
    from workbench.config import preflight

    cfg = validate(cfg)
    from workbench.train.faults import check_config

    check_config(cfg)  # fault/checkpoint settings, train.resume, a writable output_dir
    if cfg.data.preview:  # tokenizer only: render samples with their loss mask and stop
        from workbench.methods.registry import spec

        shape = spec(cfg.method.name).facts.data  # the rows the method reads
        if shape == "sft" or cfg.get("env") is not None:  # chat rows, or an environment's episodes
            from workbench.data.preview import preview

            return preview(cfg)
        from workbench.data import preview_rows

        return preview_rows.preview(cfg, shape)
    facts = preflight.check(cfg)
    _say_precision(facts["run"])
    if cfg.dry_run:
        from workbench.plan.make import render, to_json

        if cfg.plan.json:  # machine-readable: the plan plus what preflight found
            print(to_json({k: v for k, v in facts.items() if k not in ("run", "tokenizer")}))
            return facts
        print(f"preflight ok: model={cfg.model.name} ({facts['n_params']:,} parameters, weights from "
              f"{facts['model_source']}), method={cfg.method.name}, peft={facts['resolved']['peft']}, "
              f"backend={cfg.backend.name}")
        for w in facts.get("warnings", []):
            print(f"warning: {w}")
        if facts.get("resume"):  # an existing run directory: where it continues and at what batch
            print(facts["resume"])
        from workbench.launch import torchrun_reason

        reason = torchrun_reason(cfg)
        if reason:
            print(f"launch: torchrun ({reason})")
        render(facts["plan"])
        return facts
    from workbench.launch import dispatch

    remote = dispatch(cfg)
    if remote is not None:
        return remote
    from workbench.train.runner import Runner

    return Runner(cfg, facts["run"], facts.get("tokenizer")).run()


def _say_precision(run) -> None:
    """"precision: bf16-mixed (auto: ...)" once per run, from the resolved run: by this process,
    unless it is a worker of this workbench's launcher (which said it already) or a rank other than
    0 of a user's torchrun."""
    from workbench.train.distributed import is_main_process, launched_here
    from workbench.train.precision import describe

    if launched_here() or not is_main_process():
        return
    summary = run.summary()
    print(describe(summary["precision"], summary.get("precision_auto")), file=sys.stderr)


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def _hydra_main(cfg: DictConfig):
    _redact_hydra_files(cfg)
    try:
        skip_bitsandbytes(needs_bitsandbytes(cfg))
        if not cfg.data.preview:  # a preview loads the tokenizer only
            import_without_incidentals("transformers.modeling_utils")  # workbench/core/imports.py
        results = run_job(cfg)
    except Exception as exc:
        from workbench.train.distributed import launched_here, launched_rank

        if launched_here():
            # A worker of this workbench's own launcher: its traceback goes to the run directory
            # (the runner's watchdog wrote it already when the run itself raised) and the launcher
            # prints the one line that names it, instead of Hydra's block or an error line per rank.
            from workbench.train.watchdog import save_traceback, traceback_path

            rank = launched_rank()
            if not traceback_path(cfg.output_dir, rank).exists():  # the runner's watchdog wrote it already
                save_traceback(cfg.output_dir, rank, exc, secret_values(cfg))
            sys.exit(getattr(exc, "exit_code", 1))
        if not isinstance(exc, UserError):
            # Hydra prints it (its error report, or Python's under HYDRA_FULL_ERROR): when its
            # traceback holds a secret, a stand-in carrying it scrubbed (workbench/core/secrets.py)
            shown = scrub_exception(exc, secret_values(cfg))
            if shown is exc:
                raise
            raise shown from None
        # the message may quote a value from the command line
        print(f"error: {scrub_text(str(exc), secret_values(cfg))}", file=sys.stderr)
        sys.exit(getattr(exc, "exit_code", 2))
    finally:
        startup.after_job()  # the garbage collector as it was before the launch (workbench/core/startup.py)
    # Hydra's Optuna sweeper and the sweep summary read the job's return value.
    if isinstance(results, dict):
        end = results.get("eval_end") or {}
        acc = [v for k, v in end.items() if k.endswith("/accuracy")]
        losses = results.get("losses") or []
        return acc[0] if acc else (losses[-1] if losses else None)
    return None


# `python -m workbench --help`: ten commands from README.md's examples, each one composing as
# written (tests/unit/test_help.py checks them).
EXAMPLES = [
    ("python -m workbench", "LoRA SFT of SmolLM2-135M-Instruct on CPU (the default)"),
    ("python -m workbench model=tiny debug=fast", "2-step smoke run on a random 2-layer model"),
    ("python -m workbench dry_run=true method=dpo model=70b hardware=8xh100", "plan only: fits? memory, time, cost"),
    ("python -m workbench data.path=chats.jsonl data.preview=true", "your own data, trained tokens marked"),
    ("python -m workbench peft=none optim.lr=2e-5", "full fine-tuning"),
    ("python -m workbench method=qlora", "NF4 base + LoRA"),
    ("python -m workbench method=dpo", "DPO on the shipped preference pairs"),
    ("python -m workbench method=grpo reward=arith_exact", "GRPO with a verifiable reward"),
    ("python -m workbench -m optim.lr=1e-4,3e-4 peft=lora,dora", "Hydra multirun sweep + summary table"),
    ("python -m workbench backend=fsdp2 hardware.procs=2", "FSDP2 on 2 processes (starts torchrun itself)"),
]


def _defaults() -> dict[str, object]:
    """conf/train.yaml's choice for each group (None: unset)."""
    from omegaconf import OmegaConf

    defaults = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "train.yaml")).get("defaults", [])
    return {k: v for d in defaults if isinstance(d, dict) for k, v in d.items() if not k.startswith("override")}


def usage() -> str:
    """The help page: the config groups and their choices (read from conf/), examples, the docs."""
    defaults = _defaults()
    rows = []
    for group in _groups():
        chosen = defaults.get(group)
        chosen = chosen if isinstance(chosen, list) else [chosen]
        choices = ", ".join(f"{c}*" if c in chosen else c for c in _choices(group))
        rows.append(f"  {group:<11} {choices}" + ("  (unset by default)" if chosen == [None] else ""))
    width = max(len(c) for c, _ in EXAMPLES)
    readme = CONF_DIR.parent / "README.md"
    return "\n".join([
        "usage: python -m workbench [group=choice ...] [key=value ...] [dry_run=true] [-m] [--cfg job]",
        "",
        "Fine-tune a language model: a run is composed from the config groups below (conf/<group>/<choice>.yaml)",
        "and any key of the composed config; the command line wins over every file.",
        "",
        "config groups (group=choice; * marks the default; group=null unsets an unset-by-default one):",
        *rows,
        "",
        "keys: key=value for any key, e.g. train.max_steps=20 optim.lr=1e-4 output_dir=runs/mine;",
        "      `python -m workbench --cfg job [overrides]` prints the composed config with every key.",
        "",
        "examples:",
        *(f"  {c:<{width}}  # {what}" for c, what in EXAMPLES),
        "",
        f"docs: {readme} (README.md: the guide and the reference), docs/ beside it;",
        "      python -m workbench.export --help, python -m workbench.report --help; Hydra's flags: --hydra-help",
        "exit status: 0 done, 2 a mistake in config, data or environment (one `error:` line), "
        "75 preempted (relaunch to resume)",
    ])


def _choices(group: str) -> list[str]:
    """A config group's choices: its conf/<group>/*.yaml, without the schema stubs (`_schema`)."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml") if not p.stem.startswith("_"))


def _groups() -> list[str]:
    """The config groups a user picks from (conf/ folders; Hydra's own settings left out)."""
    return sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "hydra")


def _unset_groups() -> set[str]:
    """Groups that conf/train.yaml leaves unchosen (`- env: null`): `env=null` on the command
    line means "none", which Hydra spells `~env`."""
    return {k for k, v in _defaults().items() if v is None}


def _nulls_as_deletions(argv: list[str]) -> list[str]:
    """`env=null` (or `~env=null`) for a group that may be unset becomes Hydra's `~env`; Hydra itself
    refuses a null group choice ("Config group override must be a string")."""
    unset = _unset_groups()
    return [f"~{a.split('=')[0].lstrip('~')}" if a.partition("=")[2] == "null" and a.split("=")[0].lstrip("~") in unset
            else a for a in argv]


def _missing_choice(exc) -> str | None:
    """`debug=fats`: the group's choices, and the closest one when it is close."""
    import difflib

    missing = getattr(exc, "missing_cfg_file", None)
    if not missing or "/" not in missing:
        return None
    group, name = missing.rsplit("/", 1)
    options = [o for o in (getattr(exc, "options", None) or _choices(group)) if not o.startswith("_")]
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    hint = f"did you mean {group}={close[0]}? " if close else ""
    return f"{group}={name}: no such choice (conf/{group}/{name}.yaml); {hint}available options: {', '.join(options)}"


def _config_keys(node, prefix: str = "") -> dict[str, bool]:
    """Every dotted key of a composed config -> whether it holds a value (False: a section)."""
    from omegaconf import DictConfig

    out = {}
    for k in node.keys() if isinstance(node, DictConfig) else ():
        path = f"{prefix}{k}"
        child = node._get_node(k)
        section = isinstance(child, DictConfig) and not child._is_none()
        out[path] = not section
        if section:
            out.update(_config_keys(child, path + "."))
    return out


def _unknown_key(key: str, value: str, argv: list[str]) -> str:
    """`train.max_step=3`: the closest existing key (edit distance) as the override to type instead,
    or the keys there are. The config the key is looked up in is composed with the command line's
    group choices (method=dpo has keys method=sft lacks)."""
    import difflib

    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    groups = set(_groups())
    picks = [a for a in argv if a.split("=")[0] in groups or "/" in a.split("=")[0]]
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="train", overrides=picks)
    except (HydraException, OmegaConfBaseException):  # the base config will do for the hint
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="train")
    keys = _config_keys(cfg)
    sections = {k for k, leaf in keys.items() if not leaf}
    keys.update({g: True for g in groups})  # method=dpo, env=calc: a group takes a choice
    parent, _, leaf = key.rpartition(".")
    if parent in sections:  # a known section: the closest of its keys
        siblings = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == parent]
        close = [f"{parent}.{m}" for m in difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.6)]
        listed = f"keys under {parent}: {', '.join(sorted(siblings))}"
    else:
        close = difflib.get_close_matches(key, list(keys), n=1, cutoff=0.6)
        listed = f"top-level keys: {', '.join(sorted(k for k in keys if '.' not in k))}"
    if close and keys[close[0]]:
        return f"{key} is not a config key; did you mean {close[0]}={value}?"
    if close:
        return f"{key} is not a config key; did you mean {close[0]}? ({listed})"
    return f"{key} is not a config key; {listed}"


def _sweep_points(argv: list[str]) -> list[list[str]] | None:
    """The command lines that cover every value of a multirun sweep once: its first point, then
    each other value of each swept override with the rest at their first. None where a sweep
    cannot be listed (an Optuna interval, a glob): Hydra's sweeper checks those itself."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(argv)
        values = [[f"{o.input_line.split('=', 1)[0]}={v}" for v in o.sweep_string_iterator()]
                  if o.is_sweep_override() else [o.input_line] for o in parsed]
    except HydraException:
        return None
    first = [v[0] for v in values]
    points = [first] + [first[:i] + [v] + first[i + 1:] for i, vs in enumerate(values) for v in vs[1:]]
    return points


def _precheck(argv: list[str]) -> None:
    """Hydra's own composition errors (a group choice that does not exist, a key that does not,
    a value of the wrong type) as one `error:` line and status 2, like every other mistake,
    instead of Hydra's multi-line report and status 1. Every group refuses an unknown choice
    alike, with its options (conf/train.yaml marks none of them `optional`, which would drop the
    choice silently); an unknown key gets the closest existing one, never Hydra's `+key=` hint
    (which only fails later, in validation). A multirun (-m) is checked at every value of its
    sweeps before the first job starts. Composing once more costs ~0.1 s a point; Hydra's other
    flags and --config-path runs are left to Hydra."""
    flags = [a for a in argv if a.startswith("-")]
    if any(f not in ("-m", "--multirun") for f in flags):
        return
    overrides = [a for a in argv if not a.startswith("-")]
    typed = dict(a.split("=", 1) for a in overrides if "=" in a)  # a sweep's hint keeps its values
    for point in (_sweep_points(overrides) or []) if flags else [overrides]:
        _compose_or_exit(point, typed)


def _compose_or_exit(argv: list[str], typed: dict[str, str]) -> None:
    """Compose conf/train.yaml with `argv`; on a mistake print its one line and exit 2. `typed`:
    each key's value as the command line wrote it."""
    import re

    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException, MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            compose(config_name="train", overrides=list(argv))
    except (HydraException, OmegaConfBaseException) as exc:
        msg = " ".join(str(exc).split()).split(" Config search path:")[0].replace(" _schema", "")
        unknown = re.match(r"Could not override '([^']+)'", msg)
        cause = exc.__cause__
        if isinstance(exc, MissingConfigException) and _missing_choice(exc):
            msg = _missing_choice(exc)
        elif unknown and cause is not None and "not in" in str(cause):
            key = unknown.group(1)
            msg = _unknown_key(key, typed.get(key, "..."), argv)
        elif cause is not None and str(cause).strip():  # e.g. why a value does not fit its field
            msg += ": " + str(cause).strip().splitlines()[0]
        print(f"error: {scrub_text(msg)}", file=sys.stderr)  # the message may quote a value
        sys.exit(2)


def main() -> None:
    if any(a in ("--help", "-h") for a in sys.argv[1:]):  # ours, not Hydra's page (that is --hydra-help)
        print(usage())
        sys.exit(0)
    sys.argv[1:] = _nulls_as_deletions(sys.argv[1:])
    _precheck(sys.argv[1:])
    _hydra_main()


if __name__ == "__main__":
    main()
