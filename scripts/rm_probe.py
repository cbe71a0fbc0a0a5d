"""Where a model holds the "right vs wrong number" signal of the shipped preference pairs.

    python scripts/rm_probe.py                                  # the packaged SmolLM2 (converted cache)
    python scripts/rm_probe.py --model runs/<sft run>/export/merged
    python scripts/rm_probe.py --model ... --readout mean        # another read-out than the head's

A reward model (method=rm) scores a pair from one hidden state: the last token's, through a
linear head. This script asks whether that state separates a right sum from a wrong one before
any reward-model training, and compares it with what the model's own likelihood knows:
- `logprob`: the share of held-out pairs whose chosen completion has the higher summed log-prob
  (the quantity DPO and SimPO rank with);
- `probe_by_layer`: a logistic regression without bias on h_chosen - h_rejected at the last
  token of each completion (the reward model's read-out), one per decoder layer's output (the
  embeddings are left out: both completions end on the same end-of-turn token), fitted on
  `--train` pairs of data_recipes/data/arith_dpo_train.jsonl, scored on the held-out pairs.
  `--readout` asks the same of other positions: `last-1`/`last-2` (tokens before the last: the
  answer's digits) or `mean` (the average over the completion's tokens).
Both are reported for the pairs whose rejected side is a wrong number (the other half, bare
answer against rambling, is separable at once). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DATA = ROOT / "data_recipes" / "data"
READOUTS = {"last": 0, "last-1": 1, "last-2": 2, "mean": None}  # tokens back from the last one


def number_pairs(path: Path, n: int) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in rows if r["rejected"].strip().lstrip("-").isdigit()][:n]


@torch.no_grad()
def features(model, pairs, pad_id: int, batch: int = 32, readout: str = "last") -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs, layers + 1, hidden) h_chosen - h_rejected at each completion's `readout` (READOUTS),
    and (pairs,) log p(chosen) - log p(rejected) over the completion tokens."""
    diffs, margins = [], []
    for i in range(0, len(pairs), batch):
        chunk = pairs[i:i + batch]
        seqs = [p.chosen for p in chunk] + [p.rejected for p in chunk]
        width = max(len(x) for x, _ in seqs)
        ids = torch.full((len(seqs), width), pad_id)
        labels = torch.full((len(seqs), width), -100)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for j, (x, y) in enumerate(seqs):  # right padding: the last real token is at mask.sum() - 1
            ids[j, :len(x)], labels[j, :len(y)], mask[j, :len(x)] = torch.tensor(x), torch.tensor(y), 1
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        last = mask.sum(1) - 1
        rows = torch.arange(len(seqs))
        if readout == "mean":  # over the completion's tokens (the positions that carry labels)
            w = (labels != -100).float()
            w = w / w.sum(1, keepdim=True)
            h = torch.stack([torch.einsum("bth,bt->bh", s, w) for s in out.hidden_states], dim=1)
        else:
            at = last - READOUTS[readout]
            h = torch.stack([s[rows, at] for s in out.hidden_states], dim=1)
        tgt = labels[:, 1:]
        lp = torch.log_softmax(out.logits[:, :-1].float(), -1).gather(-1, tgt.clamp(min=0)[..., None])[..., 0]
        seq_lp = (lp * (tgt != -100)).sum(1)
        hc, hr = h.chunk(2)
        lc, lr = seq_lp.chunk(2)
        diffs.append(hc - hr)
        margins.append(lc - lr)
    return torch.cat(diffs), torch.cat(margins)


def probe(train: torch.Tensor, test: torch.Tensor) -> float:
    """Held-out accuracy of a bias-free logistic regression that wants w . (h_c - h_r) > 0."""
    scale = train.std(0) + 1e-6
    x = train / scale
    w = torch.zeros(x.shape[1], requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=500)

    def closure():
        opt.zero_grad()
        loss = -F.logsigmoid(x @ w).mean() + 1e-3 * (w ** 2).sum()  # L2: 600 pairs, 576 features
        loss.backward()
        return loss

    opt.step(closure)
    return float(((test / scale) @ w.detach() > 0).float().mean())


def main(argv=None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workbench.data import chat
    from workbench.data.preference import pairs_from_rows
    from workbench.models.load import converted_dir

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(converted_dir("smollm2-135m")),
                    help="an HF model directory (default: the packaged SmolLM2 as the workbench converted it)")
    ap.add_argument("--readout", choices=list(READOUTS), default="last",
                    help="the position(s) the probes read (default: the last token, the reward head's input)")
    ap.add_argument("--train", type=int, default=600, help="number pairs of the training file the probes fit on")
    a = ap.parse_args(argv)
    if not Path(a.model, "config.json").exists():
        raise SystemExit(f"{a.model}: no HF model there (run `make run` once to convert the packaged SmolLM2)")
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    contract = chat.setup_tokenizer(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    fit = pairs_from_rows(number_pairs(DATA / "arith_dpo_train.jsonl", a.train), tokenizer, contract)
    held = pairs_from_rows(number_pairs(DATA / "arith_pref_eval.jsonl", 10**9), tokenizer, contract)
    h_fit, _ = features(model, fit, tokenizer.pad_token_id, readout=a.readout)
    h_held, margin = features(model, held, tokenizer.pad_token_id, readout=a.readout)
    probes = [round(probe(h_fit[:, k], h_held[:, k]), 3) for k in range(1, h_fit.shape[1])]
    print(json.dumps({"model": a.model, "readout": a.readout, "fit_pairs": len(fit), "held_out_pairs": len(held),
                      "logprob": round(float((margin > 0).float().mean()), 3),
                      "probe_best": max(probes), "probe_by_layer": probes}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
