"""What `model.path` points at, said before any weights load.

`model.path` must be a Hugging Face model directory: config.json and complete weights
(model.safetensors, sharded safetensors with their index, or pytorch_model.bin). Anything else
gets one line saying what it is and what to pass instead:

- nothing there (with the closest name beside it, when one is close);
- a GGUF file, or a directory holding only one: convert it to a model directory first;
- a workbench run directory (manifest.json, checkpoints/, export/): its export/merged;
- a PEFT adapter (adapter_config.json): its base model, named in the adapter's config;
- a config.json with no weights beside it;
- a weight file that is cut short (a copy that stopped): its header promises more bytes than it has.

    from workbench.models.local_path import where_problem, weights_problem
    where_problem("/models/x")      # None, or the line: what is there and what to pass instead
    weights_problem("/models/x")    # None, or which weight file is missing or truncated

Validation calls both (workbench/models/auto.py: `config_file`, `adopt`), so a dry run refuses
what the run would; `locate` (workbench/models/load.py) calls them again for the callers that
do not validate. Nothing here reads more than a file's header.
"""

from __future__ import annotations

import difflib
import json
import zipfile
from pathlib import Path

FIX = "model.path wants a Hugging Face model directory (config.json and the weights, as save_pretrained writes them)"
RUN_MARKERS = ("manifest.json", "checkpoints", "metrics.jsonl")
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
MAX_HEADER = 100 * 1024**2  # the safetensors format's own limit on its JSON header


def _gguf(path: Path) -> bool:
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _gguf_hint(path: Path) -> str:
    return (f"{path} is a GGUF file; {FIX}. Convert it once: AutoModelForCausalLM.from_pretrained("
            f"'{path.parent}', gguf_file='{path.name}').save_pretrained(DIR) (and its tokenizer likewise), then "
            "model.path=DIR; a catalog entry that ships a GGUF (model=smollm2-135m) is converted for you")


def _merged_in(path: Path) -> Path | None:
    """A trained model inside a run directory (export/merged, or the newest exports/<step>/export/merged)."""
    for cand in (path / "export" / "merged", path / "merged"):
        if (cand / "config.json").is_file():
            return cand
    steps = sorted(path.glob("exports/*/export/merged/config.json"))
    return steps[-1].parent if steps else None


def where_problem(path: str | Path) -> str | None:
    """None when `path` is a directory with config.json; else what it is and what to pass instead."""
    given = str(path)
    p = Path(given).expanduser()
    if not p.exists():
        parent = p.parent
        names = [c.name for c in parent.iterdir()] if parent.is_dir() else []
        close = difflib.get_close_matches(p.name, names, n=1, cutoff=0.6)
        hint = f"did you mean model.path={parent / close[0]}? " if close else ""
        return f"model.path={given} does not exist; {hint}{FIX}"
    if p.is_file():
        if _gguf(p):
            return f"model.path={given}: " + _gguf_hint(p)
        if p.name == "config.json" or p.suffix in (".safetensors", ".bin", ".json"):
            return f"model.path={given} is a file; pass the directory that holds it: model.path={p.parent}"
        return f"model.path={given} is a file, not a directory; {FIX}"
    if (p / "config.json").is_file():
        return None
    if (p / "adapter_config.json").is_file():
        try:
            base = json.loads((p / "adapter_config.json").read_text()).get("base_model_name_or_path")
        except (OSError, ValueError):
            base = None
        merged = p.parent / "merged"
        if (merged / "config.json").is_file():  # a workbench run's export/adapter, beside export/merged
            instead = f"use the merged model beside it, model.path={merged}"
        elif base and Path(base).expanduser().is_dir():
            instead = f"train its base model, model.path={base}"
        elif base:
            instead = f"train its base model, model.hub_id={base}"
        else:
            instead = "train its base model (adapter_config.json names none)"
        return (f"model.path={given} is a PEFT adapter (adapter_config.json), not a whole model: {instead}; an "
                "adapter trains on only once merged into its base (python -m workbench.export writes export/merged)")
    if any((p / m).exists() for m in RUN_MARKERS) or (p / "export").is_dir():
        merged = _merged_in(p)
        if merged is not None:
            return (f"model.path={given} is a workbench run directory; its trained model is model.path={merged} "
                    f"(to continue training the run itself: output_dir={given})")
        return (f"model.path={given} is a workbench run directory with no exported model; export it "
                f"(python -m workbench.export {given}) and pass the export/merged folder it writes, or continue "
                f"training it with output_dir={given}")
    ggufs = sorted(p.glob("*.gguf"))
    if ggufs:
        return f"model.path={given} holds a GGUF file and no config.json: " + _gguf_hint(ggufs[0])
    return f"model.path={given}: no config.json there (not a Hugging Face model directory); {FIX}"


def _safetensors_problem(f: Path) -> str | None:
    """Why a .safetensors file cannot be read whole, from its header alone; None when it can."""
    size = f.stat().st_size
    try:
        with f.open("rb") as h:
            head = h.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 0 or n > min(size - 8, MAX_HEADER):
                return f"{f} is not a readable safetensors file ({size:,} bytes, no complete header)"
            header = json.loads(h.read(n))
    except (OSError, ValueError, UnicodeDecodeError):
        return f"{f} is not a readable safetensors file (its header is damaged)"
    ends = [v["data_offsets"][1] for k, v in header.items()
            if k != "__metadata__" and isinstance(v, dict) and len(v.get("data_offsets", ())) == 2]
    want = 8 + n + max(ends, default=0)
    if want > size:
        return f"{f} is truncated: {size:,} bytes where its header describes {want:,}"
    return None


def _shards(p: Path, index: str) -> list[Path] | str:
    try:
        names = sorted(set(json.loads((p / index).read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, AttributeError):
        return f"{p / index} is not a readable shard index"
    missing = [n for n in names if not (p / n).is_file()]
    if missing:
        return f"{p / index} lists {len(names)} shard(s) and {len(missing)} are missing ({', '.join(missing[:3])})"
    return [p / n for n in names]


def _zip_start(f: Path) -> bool:
    """A zip archive (torch.save since torch 1.6), not the legacy pickle format, which has no directory to check."""
    with f.open("rb") as h:
        return h.read(2) == b"PK"


def weights_problem(path: str | Path) -> str | None:
    """None when the model directory's weights are all there and whole; else which file, and the fix."""
    p = Path(str(path)).expanduser()
    given = f"model.path={path}"
    if (p / "model.safetensors").is_file():
        files = [p / "model.safetensors"]
    elif (p / SAFETENSORS_INDEX).is_file():
        files = _shards(p, SAFETENSORS_INDEX)
    elif (p / "pytorch_model.bin").is_file():
        files = [p / "pytorch_model.bin"]
    elif (p / BIN_INDEX).is_file():
        files = _shards(p, BIN_INDEX)
    else:
        ggufs = sorted(p.glob("*.gguf"))
        also = f" (there is a GGUF file, {ggufs[0].name}: {_gguf_hint(ggufs[0])})" if ggufs else ""
        return (f"{given} has config.json but no weights (model.safetensors, sharded safetensors with "
                f"{SAFETENSORS_INDEX}, or pytorch_model.bin){also}; save the model there with "
                "model.save_pretrained(dir), or point model.path at the directory that has its weights")
    if isinstance(files, str):
        return f"{given}: {files}; copy the model directory again"
    for f in files:
        if f.suffix == ".safetensors":
            why = _safetensors_problem(f)
        else:  # torch.save writes a zip archive, whose directory sits at its end: a cut copy has none
            why = None if not _zip_start(f) or zipfile.is_zipfile(f) else f"{f} is truncated (no zip directory at its end)"
        if why:
            return f"{given}: {why}; copy or save the model again"
    return None
