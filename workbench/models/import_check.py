"""The import check: a model converted from a GGUF is the model the GGUF holds, before anything
trains on it.

    report = check(gguf_path, model, tokenizer)   # dict: passed, against, figures, first difference
    line(report)                                  # "import check passed against llama.cpp 0.3.36: ..."

Two things are compared on one fixed text (TEXT), against llama.cpp (llama-cpp-python, the
reference runtime for GGUF files) reading the same file:
- the token ids, with the GGUF's BOS/EOS rules: every id must be equal; the first difference is
  named with both pieces;
- the next-token log-probabilities the converted model gives each token of the text, against
  llama.cpp's: their mean absolute difference must stay under LOGPROB_TOLERANCE.
Without llama-cpp-python the converted model's perplexity on TEXT, as its own tokenizer encodes
it, must stay under PPL_BOUND.

workbench/models/convert.py runs it right after converting and keeps the report beside the
converted weights (import_check.json); a model that fails is not cached, and the run stops with
one line naming what disagrees.

A report made without llama.cpp is redone once llama-cpp-python is installed (`refresh`, from
workbench/models/load.py `import_report`): the weights converted then are checked against the
reference they lacked, in a child process (`python -m workbench.models.import_check GGUF DIR`),
and the new report replaces the old one in the cache entry (resealed). One that disagrees stops
the run in one line naming the entry to remove.

    report = refresh(report, converted_dir, gguf_path, assemble, name)
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

from workbench.core import atomic, cache
from workbench.core.errors import UserError

REPORT = "import_check.json"
TEXT = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France, and Berlin is the "
        "capital of Germany.")
# whose ids must match too: runs of spaces, newlines and tabs (whole pieces in some vocabularies),
# digits, accents, emoji and a script without spaces
TOKENS_ONLY = "  What is 37 + 45?\n\nAnswer:\t82   (café, 🙂, 日本語)\n"
# llama.cpp computes with the GGUF's quantised blocks (and quantised activations in its dot
# products) where the converted model holds them dequantised in fp32, so the two log-probs differ
# by that rounding: mean |diff| 0.064 on SmolLM2-135M (Q4_1) and 0.093 on Gemma 3 270M (Q4_K_M)
# on this machine. A damaged conversion is far above: SmolLM2 with every norm weight shifted by 1
# gives 17.0 (tests/integration/test_import_check.py). 0.25 is 2.7x the largest good figure.
LOGPROB_TOLERANCE = 0.25
# Without llama.cpp: perplexity of the text under the converted model. Good conversions read it
# at 11.4 (Gemma 3 270M) and 14.3 (SmolLM2-135M); Gemma with transformers' fragmenting tokenizer
# at 7,296, with only its <bos> restored at 1,170. 60 leaves a small model room and catches both.
PPL_BOUND = 60.0


NO_REFERENCE = "llama-cpp-python is not installed"  # what a report made without llama.cpp says it lacked


def _piece(tokenizer, i: int) -> str:
    return repr(tokenizer.convert_ids_to_tokens(int(i)))


def _logprobs(logits, ids) -> list[float]:
    """log p(ids[t+1] | ids[:t+1]) for each position t, from (positions x vocab) logits."""
    import torch

    lp = torch.log_softmax(torch.as_tensor(logits, dtype=torch.float64), dim=-1)
    return [float(lp[t, ids[t + 1]]) for t in range(len(ids) - 1)]


def _first_difference(tokenizer, text: str, mine: list[int], theirs: list[int]) -> str:
    at = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
    here = f"{mine[at]} {_piece(tokenizer, mine[at])}" if at < len(mine) else "the end"
    there = f"{theirs[at]} {_piece(tokenizer, theirs[at])}" if at < len(theirs) else "the end"
    return (f"token ids differ from llama.cpp's at position {at} of {text[:40]!r}...: {here} here, {there} in "
            f"llama.cpp ({len(mine)} vs {len(theirs)} tokens)")


def _hf_logprobs(model, ids: list[int]) -> list[float]:
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    return _logprobs(logits, ids)


def _llama_cpp(gguf_path: str):
    """llama.cpp's model of the file, or None when llama-cpp-python is not installed."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    return Llama(model_path=str(gguf_path), n_ctx=512, logits_all=True, verbose=False, n_threads=2)


def check(gguf_path: str | Path, model, tokenizer) -> dict:
    """Compare the converted `model` and `tokenizer` with llama.cpp's reading of `gguf_path`."""
    ids = list(tokenizer(TEXT)["input_ids"])
    llm = _llama_cpp(gguf_path)
    try:
        return _compare(llm, model, tokenizer, ids)
    finally:
        if llm is not None:
            llm.close()  # now, not from its finaliser at interpreter exit (which prints a traceback)


def _compare(llm, model, tokenizer, ids: list[int]) -> dict:
    if llm is None:
        lps = _hf_logprobs(model, ids)
        ppl = math.exp(-sum(lps) / len(lps))
        return {"passed": ppl <= PPL_BOUND, "against": f"a perplexity bound of {PPL_BOUND:g} ({NO_REFERENCE})",
                "tokens": len(ids), "perplexity": ppl,
                "problem": None if ppl <= PPL_BOUND else f"perplexity {ppl:,.1f} on the check text is over "
                                                        f"{PPL_BOUND:g}: tokenizer or weights are off"}
    import llama_cpp

    against = f"llama.cpp (llama-cpp-python {llama_cpp.__version__})"
    report = {"against": against}
    for text in (TEXT, TOKENS_ONLY):  # llama.cpp adds BOS/EOS as the GGUF's rules say (add_special)
        here = ids if text is TEXT else list(tokenizer(text)["input_ids"])
        theirs = llm.tokenize(text.encode(), add_bos=True, special=False)
        if here != theirs:
            return {**report, "passed": False, "problem": _first_difference(tokenizer, text, here, theirs)}
    ref = ids
    report["tokens"] = len(ref)
    llm.reset()
    llm.eval(ref)
    theirs = _logprobs(llm.scores[: len(ref)], ref)
    mine = _hf_logprobs(model, ref)
    diffs = [abs(a - b) for a, b in zip(mine, theirs, strict=True)]
    mean = sum(diffs) / len(diffs)
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    report.update(mean_abs_logprob_diff=mean, max_abs_logprob_diff=diffs[worst],
                  perplexity=math.exp(-sum(mine) / len(mine)), perplexity_llama_cpp=math.exp(-sum(theirs) / len(theirs)))
    report["passed"] = mean <= LOGPROB_TOLERANCE
    report["problem"] = None if report["passed"] else (
        f"next-token log-probs differ from llama.cpp's by {mean:.3f} on average (tolerance {LOGPROB_TOLERANCE}), "
        f"most at position {worst + 1} ({_piece(tokenizer, ref[worst + 1])}: {mine[worst]:.3f} here, "
        f"{theirs[worst]:.3f} in llama.cpp): the converted weights are not the GGUF's")
    return report


def line(report: dict) -> str:
    """The report as the one line a run prints at start (or the error line)."""
    if not report["passed"]:
        return f"import check failed against {report['against']}: {report['problem']}"
    if "mean_abs_logprob_diff" in report:
        return (f"import check passed against {report['against']}: token ids identical on a {report['tokens']}-token "
                f"text, next-token log-probs within {report['mean_abs_logprob_diff']:.3f} on average "
                f"(tolerance {LOGPROB_TOLERANCE}); perplexity {report['perplexity']:.2f} here, "
                f"{report['perplexity_llama_cpp']:.2f} in llama.cpp")
    return f"import check passed against {report['against']}: perplexity {report['perplexity']:.2f} on a " \
           f"{report['tokens']}-token text"


# -- a report made without the reference, redone once it is there --------------------------------
def reference_available() -> bool:
    """Whether llama-cpp-python can be imported here (found, not imported: it is slow to load)."""
    return importlib.util.find_spec("llama_cpp") is not None


def stale(report: dict | None) -> bool:
    """A report that passed only against the perplexity bound because llama.cpp was missing, on a
    machine where it is now installed."""
    return bool(report) and NO_REFERENCE in str(report.get("against", "")) and reference_available()


def _run_child(gguf: Path, converted: Path) -> dict | None:
    """The check of the converted weights in `converted` against `gguf`, in a process of its own
    (the model and llama.cpp freed when it ends; workbench/models/convert.py says why a child);
    None, with the reason on stderr, when the child could not run it."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")}
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(x for x in (src, env.get("PYTHONPATH")) if x)
    proc = subprocess.run([sys.executable, "-m", "workbench.models.import_check", str(gguf), str(converted)],
                          env=env, capture_output=True, text=True)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None
    except (IndexError, ValueError):
        return None
    finally:
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            print(f"warning: the import check could not be redone against llama.cpp ({tail}); keeping the cached "
                  "verdict", file=sys.stderr)


def refresh(report: dict | None, converted: Path, gguf: Path | None, assemble=None, name: str = "") -> dict | None:
    """`report` (the cache entry `converted`'s import_check.json) as it is, or redone against
    llama.cpp when it was made without it and llama-cpp-python is installed now (`stale`).
    `gguf`: the file it was converted from; `assemble(path)` joins it from a package's parts when
    it is not on disk (removed again afterwards). One process redoes it, under the entry's lock."""
    if not stale(report) or gguf is None:
        return report
    converted, gguf = Path(converted), Path(gguf)
    with cache.lock(converted):
        current = json.loads((converted / REPORT).read_text())
        if not stale(current):  # another process redid it while this one waited
            return current
        joined = False
        if not gguf.exists():
            if assemble is None:
                return current
            assemble(gguf)
            joined = True
        print(f"model: llama-cpp-python is installed now; redoing the import check of {converted} against it "
              "(its cached verdict was against a perplexity bound)", file=sys.stderr, flush=True)
        try:
            new = _run_child(gguf, converted)
        finally:
            if joined:
                gguf.unlink(missing_ok=True)
        if new is None:
            return current
        if not new["passed"]:
            raise UserError(f"model={name or converted.name}: {line(new)}; the weights cached at {converted} were "
                            "converted before llama-cpp-python was installed: remove that directory to convert again")
        atomic.write_text(converted / REPORT, json.dumps(new, indent=1))
        cache.seal(converted)  # the entry's seal records each file's size
        return new


def _main(gguf: str, converted: str) -> None:
    """The child of `_run_child`: the check of the converted directory, its report as JSON on stdout."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(converted)
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    print(json.dumps(check(gguf, model, tok)))


if __name__ == "__main__":
    _main(*sys.argv[1:3])
