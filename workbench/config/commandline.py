"""What a command line asks for, read before Hydra composes it: the help page, the config groups
and their choices (conf/), and a check of the overrides that turns Hydra's composition errors
into one line: an unknown group choice with the group's options, an unknown key with the
closest existing one (did you mean), a sweep checked at every value before its first job.

    python -m workbench --help          # usage()
    python -m workbench debug=fats      # precheck(argv) -> "debug=fats: no such choice ... did you mean debug=fast?"
"""

from __future__ import annotations

import difflib
import re

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from workbench.config.files import CONF_DIR

# `python -m workbench --help`: ten example commands, each one composing as
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


def defaults() -> dict[str, object]:
    """conf/train.yaml's choice for each group (None: unset)."""
    defaults = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "train.yaml")).get("defaults", [])
    return {k: v for d in defaults if isinstance(d, dict) for k, v in d.items() if not k.startswith("override")}


def usage() -> str:
    """The help page: the config groups and their choices (read from conf/), examples, the docs."""
    picked = defaults()
    rows = []
    for group in groups():
        chosen = picked.get(group)
        chosen = chosen if isinstance(chosen, list) else [chosen]
        listed = ", ".join(f"{c}*" if c in chosen else c for c in choices(group))
        rows.append(f"  {group:<11} {listed}" + ("  (unset by default)" if chosen == [None] else ""))
    width = max(len(c) for c, _ in EXAMPLES)
    docs = CONF_DIR.parent / "docs"
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
        f"docs: {docs} (guides, the configuration reference, measurements; `mkdocs serve` shows them as a site)",
        "      python -m workbench.export --help, python -m workbench.report --help; Hydra's flags: --hydra-help",
        "exit status: 0 done, 2 a mistake in config, data or environment (one `error:` line), 3 a rank stalled,",
        "             4 dry_run=true and the plan does not fit the configured hardware (the plan, then one",
        "             `error:` line with the smallest change that fits), 75 preempted (relaunch to resume)",
    ])


def choices(group: str) -> list[str]:
    """A config group's choices: its conf/<group>/*.yaml, without the schema stubs (`_schema`)."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml") if not p.stem.startswith("_"))


def groups() -> list[str]:
    """The config groups a user picks from (conf/ folders; Hydra's own settings left out)."""
    return sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "hydra")


def unset_groups() -> set[str]:
    """Groups that conf/train.yaml leaves unchosen (`- env: null`): `env=null` on the command
    line means "none", which Hydra spells `~env`."""
    return {k for k, v in defaults().items() if v is None}


def nulls_as_deletions(argv: list[str]) -> list[str]:
    """`env=null` (or `~env=null`) for a group that may be unset becomes Hydra's `~env`; Hydra itself
    refuses a null group choice ("Config group override must be a string")."""
    unset = unset_groups()
    return [f"~{a.split('=')[0].lstrip('~')}" if a.partition("=")[2] == "null" and a.split("=")[0].lstrip("~") in unset
            else a for a in argv]


def _missing_choice(exc) -> str | None:
    """`debug=fats`: the group's choices, and the closest one when it is close."""
    missing = getattr(exc, "missing_cfg_file", None)
    if not missing or "/" not in missing:
        return None
    group, name = missing.rsplit("/", 1)
    options = [o for o in (getattr(exc, "options", None) or choices(group)) if not o.startswith("_")]
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    hint = f"did you mean {group}={close[0]}? " if close else ""
    return f"{group}={name}: no such choice (conf/{group}/{name}.yaml); {hint}available options: {', '.join(options)}"


def _config_keys(node, prefix: str = "") -> dict[str, bool]:
    """Every dotted key of a composed config -> whether it holds a value (False: a section)."""
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
    names = set(groups())
    picks = [a for a in argv if a.split("=")[0] in names or "/" in a.split("=")[0]]
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="train", overrides=picks)
    except (HydraException, OmegaConfBaseException):  # the base config will do for the hint
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="train")
    keys = _config_keys(cfg)
    sections = {k for k, leaf in keys.items() if not leaf}
    keys.update({g: True for g in names})  # method=dpo, env=calc: a group takes a choice
    parent, _, leaf = key.rpartition(".")
    # the sections a run is most often tuned in first: `max_new_tokens` is method.max_new_tokens before debug's
    first = ("method", "optim", "train", "data", "model", "peft")
    elsewhere = sorted((k for k, is_leaf in keys.items() if is_leaf and k.rpartition(".")[2] == leaf and k != key),
                       key=lambda k: (first.index(k.split(".")[0]) if k.split(".")[0] in first else len(first), k))
    if elsewhere:  # `lr`, `train.lr`: the key of that name in another section
        return f"{key} is not a config key; did you mean {elsewhere[0]}={value}?" + (
            f" ({leaf} is also under: {', '.join(elsewhere[1:])})" if len(elsewhere) > 1 else "")
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
    try:
        parsed = OverridesParser.create().parse_overrides(argv)
        values = [[f"{o.input_line.split('=', 1)[0]}={v}" for v in o.sweep_string_iterator()]
                  if o.is_sweep_override() else [o.input_line] for o in parsed]
    except HydraException:
        return None
    first = [v[0] for v in values]
    points = [first] + [first[:i] + [v] + first[i + 1:] for i, vs in enumerate(values) for v in vs[1:]]
    return points


def per_job_output_dir(argv: list[str]) -> tuple[list[str], str | None]:
    """A multirun whose command line fixes `output_dir=DIR` would train every job in that one
    directory: the second job would resume the first one's checkpoint and report its results. Each
    job trains in `DIR/<job number>` instead (Hydra's `${hydra:job.num}`, resolved per job, so the
    sweep summary and every job's files name the directory it used). Returns the command line to
    give Hydra and the line that says so (None when nothing changed)."""
    if not any(a in ("-m", "--multirun") for a in argv):
        return argv, None
    out = []
    note = None
    for a in argv:
        key, eq, value = a.partition("=")
        if eq and key.lstrip("+") == "output_dir" and value and "${" not in value and not _is_sweep(a):
            quoted = value.strip("'\"").replace("\\", "\\\\").replace("'", "\\'")
            a = f"{key}='{quoted.rstrip('/')}/${{hydra:job.num}}'"
            note = (f"sweep: output_dir={value} holds one directory per job ({value.rstrip('/')}/<job number>): "
                    "a run directory belongs to one config")
        out.append(a)
    return out, note


def _is_sweep(override: str) -> bool:
    try:
        return OverridesParser.create().parse_overrides([override])[0].is_sweep_override()
    except HydraException:
        return False


# Hydra's flags that print or change how a run is shown, not which config composes: the
# overrides beside them are checked like any run's (`--cfg job train.max_step=3` gets the same
# one line). `--info`'s value is optional; every other listed flag takes one.
VALUE_FLAGS = ("--cfg", "-c", "--package", "-p", "--info", "-i")
OPTIONAL_VALUE = ("--info", "-i")
PLAIN_FLAGS = ("--resolve", "--run", "-r")


def precheck(argv: list[str]) -> str | None:
    """The one-line message for Hydra's own composition errors (a group choice that does not exist, a key that does not,
    a value of the wrong type) as one `error:` line and status 2, like every other mistake,
    instead of Hydra's multi-line report and status 1. Every group refuses an unknown choice
    alike, with its options (conf/train.yaml marks none of them `optional`, which would drop the
    choice silently); an unknown key gets the closest existing one, never Hydra's `+key=` hint
    (which only fails later, in validation). A multirun (-m) is checked at every value of its
    sweeps before the first job starts. Composing once more costs ~0.1 s a point; Hydra's other
    flags and --config-path runs are left to Hydra."""
    overrides, flags, rest = [], [], list(argv)
    while rest:
        a = rest.pop(0)
        if not a.startswith("-"):
            overrides.append(a)
        elif a in ("-m", "--multirun"):
            flags.append(a)
        elif a in VALUE_FLAGS:  # `--cfg job`: the flag's value is not an override
            if rest and not rest[0].startswith("-") and (a not in OPTIONAL_VALUE or "=" not in rest[0]):
                rest.pop(0)
        elif a.split("=")[0] not in VALUE_FLAGS and a not in PLAIN_FLAGS:
            return None  # --config-path, --config-name, ...: another config than conf/, left to Hydra
    typed = dict(a.split("=", 1) for a in overrides if "=" in a)  # a sweep's hint keeps its values
    for point in (_sweep_points(overrides) or []) if flags else [overrides]:
        mistake = _mistake(point, typed) or _output_dir_mistake(point)
        if mistake:
            return mistake
    return None


def _output_dir_mistake(argv: list[str]) -> str | None:
    """An output_dir that is (or lies under) a file: Hydra makes the run directory before the job
    starts, and would stop with a traceback."""
    from pathlib import Path

    for a in argv:
        key, eq, value = a.partition("=")
        if not eq or key.lstrip("+~") not in ("output_dir", "hydra.run.dir"):
            continue
        value = value.strip("'\"")
        where = Path(value.split("${")[0].rstrip("/") or ".").expanduser()  # a sweep's job subdir: its base
        for p in (where, *where.parents):
            if p.exists():
                if not p.is_dir():
                    return (f"{key.lstrip('+~')}={value}: {p} is a file, not a directory; choose another output_dir "
                            "(a new directory, or an earlier run's to resume it)")
                break
    return None


def _mistake(argv: list[str], typed: dict[str, str]) -> str | None:
    """Compose conf/train.yaml with `argv`: None, or the mistake's one line. `typed`: each key's
    value as the command line wrote it."""
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
        return msg
    return None
