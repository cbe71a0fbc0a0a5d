"""An exported GGUF in llama.cpp, the engine it is written for: the same prompts as the parity gate
(workbench/export/parity.py), tokenised by llama.cpp from the chat template's text and answered
greedily, against the merged model in transformers.

    report = check("export/gguf/model-f16.gguf", merged, tokenizer, conversations, eot_id, must_match=True)
    report["passed"]  # llama.cpp's token ids are the tokenizer's on every prompt, it stops on the
                      # end-of-turn token wherever transformers does, and (lossless formats) its
                      # greedy answers are transformers' answers

The parity gate reads the GGUF back with transformers, which checks the weights; this check is
what a user of the file meets: llama.cpp's own tokenizer of the file (pieces, scores, BOS rule),
its reading of the architecture's metadata (sliding window, norms), and the stop token it
declares. llama-cpp-python is optional (`make` installs it); without it the report says so and
the export is judged by the parity gate alone.
"""

from __future__ import annotations

import os
from pathlib import Path

from workbench.data.chat import prompt_ids
from workbench.rollout.generate import generate


def check(path: str | Path, reference, tokenizer, conversations: list, eot_id: int, must_match: bool,
          max_new_tokens: int = 16) -> dict:
    try:
        import llama_cpp
    except ImportError:
        return {"ran": False, "passed": True, "why": "llama-cpp-python is not installed (`make` installs it)"}
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=2048, verbose=False, n_threads=min(4, os.cpu_count() or 1))
    try:
        return _compare(llm, reference, tokenizer, conversations, eot_id, must_match, max_new_tokens,
                        f"llama.cpp (llama-cpp-python {llama_cpp.__version__})")
    finally:
        llm.close()  # now, not from its finaliser at interpreter exit (which prints a traceback)


def _compare(llm, reference, tokenizer, conversations, eot_id, must_match, max_new_tokens, against) -> dict:
    ours = generate(reference, tokenizer, conversations, max_new_tokens, eot_id)
    report = {"ran": True, "against": against, "prompts": len(conversations), "tokens_equal": 0,
              "greedy_equal": 0, "stops": 0, "reference_stops": 0, "first_difference": None}
    for conv, mine in zip(conversations, ours, strict=True):
        ids = prompt_ids(tokenizer, conv)
        text = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        # special=True: the template's markers (<|im_start|>, <start_of_turn>, <bos>) are tokens,
        # as llama.cpp's chat path reads them; add_bos=False: the template writes its own
        theirs_ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        report["tokens_equal"] += theirs_ids == ids
        answer, stopped = _greedy(llm, ids, eot_id, max_new_tokens)
        report["greedy_equal"] += answer == mine
        reference_stopped = len(mine) < max_new_tokens  # generate() strips the end-of-turn token
        report["reference_stops"] += reference_stopped
        report["stops"] += stopped and reference_stopped
        if report["first_difference"] is None and (theirs_ids != ids or answer != mine):
            report["first_difference"] = {
                "prompt": text[-80:], "tokens_equal": theirs_ids == ids,
                "transformers": tokenizer.decode(mine), "llama_cpp": tokenizer.decode(answer)}
    report["passed"] = bool(report["tokens_equal"] == report["prompts"]
                            and report["stops"] == report["reference_stops"]
                            and (report["greedy_equal"] == report["prompts"] or not must_match))
    return report


def _greedy(llm, ids: list[int], eot_id: int, max_new_tokens: int) -> tuple[list[int], bool]:
    """llama.cpp's greedy answer to `ids` (the end-of-turn token stripped, as generate() strips
    it) and whether it stopped: on a token the file marks end-of-generation, as a server stops."""
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    out = []
    for token in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        if llama_cpp.llama_vocab_is_eog(vocab, token):
            return out, token == eot_id
        out.append(int(token))
        if len(out) == max_new_tokens:
            break
    return out, False


def counts(report: dict) -> str:
    """What agreed, as the summary line and the model card's column say it."""
    n = report["prompts"]
    return (f"token ids {report['tokens_equal']}/{n}, greedy answers {report['greedy_equal']}/{n} as transformers', "
            f"end-of-turn stop {report['stops']}/{report['reference_stops']}")


def line(name: str, report: dict) -> str:
    """The report as one line of the export summary."""
    if not report.get("ran"):
        return f"{name} in llama.cpp: not checked ({report['why']})"
    head = f"{name} in llama.cpp: {counts(report)}"
    if report["passed"]:
        return head
    return f"{head}; first difference: {report['first_difference']}"
