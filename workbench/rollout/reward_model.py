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
assistant text, the end-of-turn token), right-padded in batches of `reward.batch_size`; the
classifier reads the last non-padding token. The policy's tokenizer may differ from the reward
model's: only the completion text crosses over.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from workbench.errors import UserError


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

    from workbench.data.formats import setup_tokenizer

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

    def __init__(self, directory: Path, batch_size: int = 16, device: str = "cpu"):
        if batch_size < 1:
            raise UserError(f"reward.batch_size must be >= 1 (got {batch_size})")
        self.dir = Path(directory)
        self.batch_size = int(batch_size)
        self.device = device
        self.model = None
        self.tokenizer = None
        self.contract = None

    @classmethod
    def from_spec(cls, spec) -> ModelReward:
        get = spec.get if hasattr(spec, "get") else (lambda k, d=None: d)
        return cls(model_dir(get("path")), int(get("batch_size", 16) or 16), str(get("device", "cpu") or "cpu"))

    def load(self) -> None:
        self.model, self.tokenizer, self.contract = _load(str(self.dir.resolve()), self.device)

    def encode(self, prompts: list, completions: list[str]) -> list[list[int]]:
        """Token ids of each prompt + completion as method=rm tokenised its pairs."""
        from workbench.data.formats import tokenize_chats

        convs = [list(p) + [{"role": "assistant", "content": c}] for p, c in zip(prompts, completions)]
        return [ids for ids, _labels in tokenize_chats(self.tokenizer, convs, self.contract, "assistant")]

    @torch.inference_mode()
    def __call__(self, prompts, completions, **_) -> list[float]:
        if self.model is None:
            self.load()
        seqs = self.encode(prompts, completions)
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
