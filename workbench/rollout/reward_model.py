"""`reward=model`: a trained reward model (a sequence classifier) as a GRPO reward function.

    python -m workbench method=rm output_dir=runs/rm                          # train one
    python -m workbench method=grpo reward=model reward.path=runs/rm          # use it
    python -m workbench method=grpo reward=model reward.path=/models/my-rm reward.batch_size=32

`reward.path` is a method=rm run directory (its `export/merged/`) or any directory holding a
transformers *ForSequenceClassification with one label plus its tokenizer. The directory is
checked when the reward is resolved (GRPO's check, before the policy loads): a missing path, a
run without an export, or a model that is not a one-label sequence classifier stop the run with
one line. The weights load once, at the first scoring, on the run's device (`reward.device`,
the run's hardware.device), and score without gradient.

Each completion is rendered after its prompt with the reward model's own tokenizer and chat
template, exactly as method=rm tokenised its training pairs (the prompt's generation prompt, the
assistant text, the end-of-turn token); the classifier reads the last token that is not its pad
token. The policy's tokenizer may differ from the reward model's: only the completion text
crosses over.

Layout: GRPO scores `num_generations` completions of each prompt. With `reward.share_prompt`
(the default) the completions of one prompt are one row, the prompt read once and each
completion a branch that sees only the prompt and itself (workbench/data/pair_tree.py
branch_batch, the layout GRPO and method=rm train in), and the score head reads each branch's
last token; a forward holds whole prompts' groups up to `reward.batch_size` completions (one
group alone when it is larger). The scores are the classifier's own on right-padded rows up to
rounding (tests/unit/test_rm.py checks Llama, Qwen2/3, Mistral, Gemma 2 and Phi-3 classifiers).
A classifier without a decoder at `.model` and a linear `.score`, whose attention does not take
a 4-D mask, or whose sliding window is shorter than the sequences (pair_tree.config_unsupported)
scores right-padded rows of `reward.batch_size` completions, as with `reward.share_prompt=false`.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from workbench.core.errors import UserError
from workbench.data import pair_tree
from workbench.data.chat import IGNORE, setup_tokenizer, tokenize_chats


def model_dir(path) -> Path:
    """The directory holding the sequence classifier: `path` itself or a run's export/merged;
    UserError naming `reward.path` when it is neither."""
    if path is None or str(path) in ("", "None", "null"):
        raise UserError("reward=model needs reward.path: a method=rm run directory or a reward model directory")
    p = Path(str(path)).expanduser()
    if not p.exists():
        raise UserError(f"reward.path={path}: not found")
    for cand in (p, p / "export" / "merged"):
        if (cand / "config.json").is_file():
            _check_classifier(cand, path)
            return cand
    if (p / "config.yaml").is_file():  # a workbench run directory without an export
        raise UserError(f"reward.path={path}: this run has no export/merged/ (trained with train.export=false?); "
                        f"export it with `python -m workbench.export {p}`")
    raise UserError(f"reward.path={path}: no config.json here or in export/merged/; not a reward model directory")


def _check_classifier(d: Path, path) -> None:
    try:
        config = json.loads((d / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"reward.path={path}: {d / 'config.json'} is unreadable ({exc})") from None
    archs = config.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        hint = " (the export of a method=rm run is one; this looks like a causal LM)" if any(
            a.endswith("ForCausalLM") for a in archs) else ""
        raise UserError(f"reward.path={path}: {d} is not a reward model: architectures {archs} name no "
                        f"*ForSequenceClassification{hint}")
    labels = len(config.get("id2label") or {}) or int(config.get("num_labels", 2))
    if labels != 1:
        raise UserError(f"reward.path={path}: {d} is a {labels}-label classifier; a reward model has one label")
    if not any((d / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise UserError(f"reward.path={path}: {d} holds no tokenizer (tokenizer.json); the completions cannot be "
                        "rendered as the reward model saw them")


@functools.cache
def _load(directory: str, device: str):
    """(model, tokenizer, contract), once per directory and device for the whole process: the
    training rollouts and the `reward` evaluation resolve the reward separately and share these."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer


    tokenizer = AutoTokenizer.from_pretrained(directory)
    contract = setup_tokenizer(tokenizer)
    model = AutoModelForSequenceClassification.from_pretrained(directory, dtype="auto")
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    model = model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, tokenizer, contract


class ModelReward:
    """A reward function (`fn(prompts=, completions=, **_) -> [float]`) backed by a sequence
    classifier. Construct with `from_spec(reward_node)`; the weights load at the first call."""

    def __init__(self, directory: Path, batch_size: int = 16, device: str = "cpu", share_prompt: bool = True):
        if batch_size < 1:
            raise UserError(f"reward.batch_size must be >= 1 (got {batch_size})")
        self.dir = Path(directory)
        self.batch_size = int(batch_size)
        self.device = device
        self.share_prompt = bool(share_prompt)
        self.model = None
        self.tokenizer = None
        self.contract = None

    @classmethod
    def from_spec(cls, spec) -> ModelReward:
        get = spec.get if hasattr(spec, "get") else (lambda k, d=None: d)
        share = get("share_prompt", True)
        return cls(model_dir(get("path")), int(get("batch_size", 16) or 16), str(get("device", "cpu") or "cpu"),
                   True if share is None else bool(share))

    def load(self) -> None:
        self.model, self.tokenizer, self.contract = _load(str(self.dir.resolve()), self.device)

    def encode(self, prompts: list, completions: list[str]) -> list[list[int]]:
        """Token ids of each prompt + completion as method=rm tokenised its pairs."""
        convs = [list(p) + [{"role": "assistant", "content": c}] for p, c in zip(prompts, completions)]
        return [ids for ids, _labels in tokenize_chats(self.tokenizer, convs, self.contract, "assistant")]

    @torch.inference_mode()
    def __call__(self, prompts, completions, **_) -> list[float]:
        if self.model is None:
            self.load()
        seqs = self.encode(prompts, completions)
        if self.share_prompt and tree_unsupported(self.model, max((len(x) for x in seqs), default=0)) is None:
            return self.tree_scores(prompts, seqs)
        return self.row_scores(seqs)

    def row_scores(self, seqs: list[list[int]]) -> list[float]:
        """Right-padded rows of `batch_size` sequences through the classifier's own forward."""
        pad = self.model.config.pad_token_id
        out: list[float] = []
        for i in range(0, len(seqs), self.batch_size):
            chunk = seqs[i:i + self.batch_size]
            width = max(len(s) for s in chunk)
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for j, s in enumerate(chunk):
                ids[j, :len(s)] = torch.tensor(s)
                mask[j, :len(s)] = 1
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
            out += logits[:, 0].float().cpu().tolist()
        return out

    def tree_scores(self, prompts, seqs: list[list[int]]) -> list[float]:
        """One row per prompt (its completions as branches), the score head at the position the
        classifier reads: each sequence's last token that is not the pad token."""
        pad = self.model.config.pad_token_id
        groups: dict[str, list[int]] = {}  # prompt -> indices of its completions, in first-seen order
        for i, p in enumerate(prompts):
            groups.setdefault(repr(p), []).append(i)
        out = [0.0] * len(seqs)
        for chunk in _fill(list(groups.values()), self.batch_size):
            order = [i for g in chunk for i in g]
            tree = pair_tree.branch_batch([[(seqs[i], [IGNORE] * len(seqs[i])) for i in g] for g in chunk], pad)
            read = [max((t for t, tok in enumerate(seqs[i]) if tok != pad), default=0) for i in order]
            hidden = self.model.model(input_ids=tree["input_ids"].to(self.device),
                                      attention_mask=tree["attention_mask"].to(self.device),
                                      position_ids=tree["position_ids"].to(self.device),
                                      use_cache=False).last_hidden_state
            scores = self.model.score(hidden[tree["seq_row"].to(self.device), pair_tree.columns(tree, read).to(self.device)])
            for i, v in zip(order, scores[:, 0].float().cpu().tolist()):
                out[i] = v
        return out


def _fill(groups: list[list[int]], limit: int) -> list[list[list[int]]]:
    """Consecutive groups packed into forwards of at most `limit` sequences (a larger group alone)."""
    out: list[list[list[int]]] = []
    for g in groups:
        if out and sum(map(len, out[-1])) + len(g) <= limit:
            out[-1].append(g)
        else:
            out.append([g])
    return out


def tree_unsupported(model, seq_len: int) -> str | None:
    """Why this classifier scores right-padded rows instead of one row per prompt (None: it need not)."""
    from torch import nn


    if not (isinstance(getattr(model, "model", None), nn.Module) and isinstance(getattr(model, "score", None), nn.Linear)):
        return f"{type(model).__name__} has no decoder at .model and linear .score"
    return pair_tree.config_unsupported(model.config, seq_len)
