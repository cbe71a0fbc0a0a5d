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
"""

from __future__ import annotations

import math
from pathlib import Path

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
        return {"passed": ppl <= PPL_BOUND, "against": f"a perplexity bound of {PPL_BOUND:g} (llama-cpp-python "
                "is not installed)", "tokens": len(ids), "perplexity": ppl,
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
