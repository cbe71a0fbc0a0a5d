"""How often a judge model agrees with `arith_exact`: the numbers behind the choice of judge for
reward=judge (docs/measurements/learning.md, "Judge agreement with arith_exact").

    .venv/bin/python scripts/judge_quality.py                       # SmolLM2-135M and Gemma 3 270M
    .venv/bin/python scripts/judge_quality.py --judge trained=runs/<run>/export/gguf/model-q8_0.gguf
    .venv/bin/python scripts/judge_quality.py --models smollm2-135m --scores yes_no --out judge.json

The 200 held-out questions of the embedded task's test split (data_recipes/data/arith_add2_eval.jsonl,
what `make run`'s evaluation asks) get one completion each: the first 100 the right answer, the
other 100 the right answer plus a nonzero offset in [-10, 10] (random.Random(seed)), so half are
right. Each judge is served by llama.cpp's OpenAI-compatible server (llama_cpp.server, the
packaged GGUF on loopback; nothing is downloaded) and asked through reward=judge's own client
(workbench/rollout/judge.py) with each scoring's built-in rubric, which shows the correct answer.
A judge calls a completion right when its score is at least 0.5; agreement is the share of the
200 on which that equals arith_exact, with the true-positive rate (right completions called
right) and true-negative rate (wrong ones called wrong), each with its Wilson 95% interval, and
the ranking accuracy (AUC: a right completion scored above a wrong one), which is what GRPO's
group-relative advantages read.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workbench.evals.stats import wilson  # noqa: E402
from workbench.rollout import judge, rewards  # noqa: E402

EVAL = ROOT / "data_recipes" / "data" / "arith_add2_eval.jsonl"


def completions(seed: int) -> tuple[list, list[str], list[str]]:
    """(prompts, completions, answers): the first half right, the second half off by a nonzero
    offset."""
    rows = [json.loads(x) for x in EVAL.read_text().splitlines()]
    rng = random.Random(seed)
    half = len(rows) // 2
    texts = []
    for i, row in enumerate(rows):
        offset = 0 if i < half else rng.choice([d for d in range(-10, 11) if d])
        texts.append(str(int(row["answer"]) + offset))
    return [r["prompt"] for r in rows], texts, [r["answer"] for r in rows]


def serve(gguf: Path, port: int, threads: int, chat_format: str | None = None):
    """llama_cpp.server on loopback until GET /v1/models answers; (process, url, start seconds)."""
    t0 = time.monotonic()
    fmt = ["--chat_format", chat_format] if chat_format else []
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", "judge",
                             "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048", "--n_threads", str(threads),
                             "--verbose", "false", *fmt], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}/v1"
    while True:
        if proc.poll() is not None:
            sys.exit(f"error: llama_cpp.server exited: {proc.stderr.read().decode()[-500:]}")
        try:
            urllib.request.urlopen(url + "/models", timeout=1).read()
            return proc, url, time.monotonic() - t0
        except OSError:
            if time.monotonic() - t0 > 180:
                proc.terminate()
                sys.exit("error: llama_cpp.server did not answer within 180 s")
            time.sleep(0.1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agreement(scores: list[float], truth: list[float]) -> dict:
    said = [s >= 0.5 for s in scores]
    right = [t == 1.0 for t in truth]
    n, pos = len(said), sum(right)
    agree = sum(a == b for a, b in zip(said, right))
    tp = sum(a and b for a, b in zip(said, right))
    tn = sum(not a and not b for a, b in zip(said, right))

    def rate(k, m):
        return {"value": k / m, "ci95": list(wilson(k, m)), "k": k, "n": m}

    return {"agreement": rate(agree, n), "tpr": rate(tp, pos), "tnr": rate(tn, n - pos),
            "called_right": sum(said) / n, "ranking": ranking(scores, right)}


def ranking(scores: list[float], right: list[bool]) -> float:
    """The share of (right, wrong) pairs in which the right completion scores higher, ties half
    (the area under the ROC curve). GRPO reads rewards within a group, relative to each other, so
    a judge that ranks right above wrong teaches even when no fixed threshold separates them."""
    pos = [s for s, r in zip(scores, right) if r]
    neg = [s for s, r in zip(scores, right) if not r]
    wins = sum((p > q) + 0.5 * (p == q) for p in pos for q in neg)
    return wins / (len(pos) * len(neg))


def judge_one(name: str, gguf: Path, scores: list[str], data, port: int, threads: int,
              chat_format: str | None = None, rubric: str | None = None, system: str | None = None) -> list[dict]:
    prompts, texts, answers = data
    truth = rewards.arith_exact(texts, answers)
    proc, url, started = serve(gguf, port, threads, chat_format)
    out = []
    try:
        for score in scores:
            fn = judge.JudgeReward.from_spec({"base_url": url, "model": "judge", "score": score, "concurrency": 1,
                                              "request_timeout_s": 120, "timeout_s": 3600, "max_unparsed_share": 1.0,
                                              "rubric": rubric, "system": system})
            fn.check_service()
            t0 = time.monotonic()
            got = fn(prompts=prompts, completions=texts, completion_ids=None, answer=answers)
            took = time.monotonic() - t0
            hows = [i["how"] for i in fn.last_info]
            row = {"judge": name, "rubric": rubric or "built-in", "system": system,
                   "gguf": gguf.name, "chat_format": chat_format or "the GGUF's", "score": score,
                   "server_start_s": round(started, 2),
                   "seconds_per_call": round(took / len(texts), 3), "unparsed": fn.totals["unparsed"],
                   "by_logprobs": hows.count("logprobs"), "by_text": hows.count("text"),
                   "mean_score_right": sum(s for s, t in zip(got, truth) if t) / max(1, sum(truth)),
                   "mean_score_wrong": sum(s for s, t in zip(got, truth) if not t) / max(1, len(truth) - sum(truth)),
                   **agreement(got, truth)}
            out.append(row)
            print(line(row), flush=True)
    finally:
        proc.terminate()
        proc.wait(10)
    return out


def pct(r: dict) -> str:
    lo, hi = r["ci95"]
    return f"{100 * r['value']:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}]"


def line(r: dict) -> str:
    return (f"| {r['judge']} | {r['score']} | {pct(r['agreement'])} | {pct(r['tpr'])} | {pct(r['tnr'])} | "
            f"{100 * r['called_right']:.0f}% | {r['ranking']:.3f} | {r['unparsed']} | {r['seconds_per_call']:.2f} s | "
            f"{r['server_start_s']:.1f} s |")


HEADER = ("| judge | score | agreement | true-positive rate | true-negative rate | called right | ranking (AUC) | "
          "unparsed | per call | server start |\n|---|---|---|---|---|---|---|---|---|---|")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="*", default=["smollm2-135m", "gemma3-270m"],
                    help="packaged models (conf/model/<name>.yaml with a gguf_package) to judge with")
    ap.add_argument("--judge", action="append", default=[], metavar="NAME=GGUF",
                    help="another judge: a GGUF file, e.g. a run's export/gguf/model-q8_0.gguf")
    ap.add_argument("--scores", nargs="*", default=["yes_no", "number"], choices=judge.SCORES)
    ap.add_argument("--chat-format", action="append", default=["gemma3-270m=gemma"], metavar="NAME=FORMAT",
                    help="the server's --chat_format for a judge whose GGUF carries no chat template (the Gemma 3 "
                         "270M package's does not: without one the server falls back to llama-2's)")
    ap.add_argument("--rubric", help="a rubric of your own for every judge and scoring (default: each scoring's "
                                     "built-in, workbench/rollout/judge.py RUBRICS)")
    ap.add_argument("--system", help="a system message before the rubric (default: none)")
    ap.add_argument("--as-trained", action="store_true", help="the rubric and system message scripts/train_judge.py "
                    "trains its judge on")
    ap.add_argument("--seed", type=int, default=0, help="the offsets of the wrong completions")
    ap.add_argument("--threads", type=int, default=2, help="the server's CPU threads")
    ap.add_argument("--port", type=int, default=0, help="0: a free port")
    ap.add_argument("--out", help="write the rows as JSON here")
    a = ap.parse_args(argv)
    # a terminated script stops its server too: SIGTERM unwinds through judge_one's finally
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    judges = [(m, judge.packaged_gguf(m)) for m in a.models]
    for spec in a.judge:
        name, _, path = spec.partition("=")
        if not path or not Path(path).is_file():
            print(f"error: --judge {spec}: write NAME=PATH to an existing .gguf file", file=sys.stderr)
            return 2
        judges.append((name, Path(path)))
    if a.as_trained:
        from scripts.train_judge import RUBRIC, SYSTEM

        a.rubric, a.system = RUBRIC, SYSTEM
    data = completions(a.seed)
    print(HEADER, flush=True)
    rows = []
    for name, gguf in judges:
        port = a.port or free_port()
        formats = dict(f.partition("=")[::2] for f in a.chat_format)
        rows += judge_one(name, gguf, a.scores, data, port, a.threads, formats.get(name) or None, a.rubric,
                          a.system)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
