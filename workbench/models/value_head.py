"""The scalar head of a reward model (method=rm): one number per sequence from the causal LM.

    from workbench.models import value_head
    value_head.attach(model)                        # build_model, when catalog facts say scalar_head
    micro["select"] = value_head.pool(input_ids, pad_id)   # the one position each row is scored at
    r = value_head.scores(model, micro)             # (rows,) through the backend's own forward
    seq = value_head.to_sequence_classifier(decoder, head_weight, pad_id)  # export

A reward model is the decoder with its vocabulary head replaced by `Linear(hidden, 1, bias=False)`,
read at each sequence's last non-padding token: exactly Hugging Face's
*ForSequenceClassification (`score`, pooled at the rightmost token that is not `pad_token_id`).
The workbench keeps the *ForCausalLM class and swaps its `lm_head` for the one-output head, so
every layer that already handles a causal LM handles the reward model unchanged:
- `SelectiveLM` (workbench/models/head.py) runs the decoder and the head on the selected positions
  only; with one selected position per row its output is the rows' rewards. The reward is
  computed inside the module's own forward, which is what DDP, FSDP2 and ZeRO hook into;
- the head is a parameter of the model the backend wraps, so it is sharded, trained (with or
  without adapters: it is created after PEFT froze the base, so it stays trainable, like PEFT's
  `modules_to_save`) and checkpointed with the other trainable tensors, and `rebuild_plain`
  finds it again because build_model attaches it on every build;
- the FLOP count reads the head's real shape (hidden x 1).
The embeddings are untied from it (the head is new), as in a sequence classifier.

Families whose causal-LM forward rescales the head's output (Gemma 2/3 soft-capping, Cohere's
logit_scale) would train a capped or scaled reward that their sequence classifier does not
compute; they are refused.
"""

from __future__ import annotations

import torch
from torch import nn

from workbench.core.errors import UserError
from workbench.models.load import cast_weights
from workbench.peft.lora import base_model


def attach(model: nn.Module) -> nn.Module:
    """Replace the causal LM's vocabulary head by a fresh scalar head (in place); returns the model.
    Initialised like transformers initialises `score`: normal(0, initializer_range)."""
    lm = base_model(model)
    config = lm.config
    for field in ("final_logit_softcapping", "logit_scale"):
        if getattr(config, field, None):
            raise UserError(f"method=rm: {type(lm).__name__} rescales its head's output ({field}="
                            f"{getattr(config, field)}), which its sequence classifier does not; this family "
                            "cannot be trained as a reward model here")
    if not (hasattr(lm, "model") and hasattr(lm, "lm_head")):
        raise UserError(f"method=rm: {type(lm).__name__} has no decoder (.model) and head (.lm_head) to put a "
                        "scalar head on")
    text = config.get_text_config()
    ref = lm.get_input_embeddings().weight
    head = nn.Linear(text.hidden_size, 1, bias=False, device=ref.device, dtype=torch.float32)
    nn.init.normal_(head.weight, mean=0.0, std=float(getattr(text, "initializer_range", 0.02)))
    lm.lm_head = head
    config.tie_word_embeddings = False  # nothing may tie the embeddings back onto the scalar head
    text.tie_word_embeddings = False
    return model


def is_attached(model: nn.Module) -> bool:
    head = getattr(base_model(model), "lm_head", None)
    return isinstance(head, nn.Linear) and head.out_features == 1


def pool(input_ids: torch.Tensor, pad_id: int) -> torch.Tensor:
    """(rows, T) bool: True at each row's rightmost token that is not `pad_id`, the position
    transformers' sequence classifiers read (so the exported model scores what was trained)."""
    idx = torch.arange(input_ids.shape[1], device=input_ids.device)
    last = (idx * (input_ids != pad_id)).argmax(dim=1)
    select = torch.zeros_like(input_ids, dtype=torch.bool)
    select[torch.arange(input_ids.shape[0], device=input_ids.device), last] = True
    return select


def scores(model, micro: dict) -> torch.Tensor:
    """Rewards of the micro-batch's rows, (rows,) in fp32. `model` is what the backend passes
    (SelectiveLM, possibly wrapped); `micro["select"]` holds one position per row (pool()), or,
    for pair rows (methods/rm.py tree_collate), one per completion, with `position_ids`, and
    `reward_slot` putting the outputs in the order of two rows per pair."""
    extra = {"position_ids": micro["position_ids"]} if "position_ids" in micro else {}
    out = model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"], select=micro["select"], **extra)
    out = out.squeeze(-1).float()
    return out[micro["reward_slot"]] if "reward_slot" in micro else out


def sequence_classifier_config(config, pad_token_id: int):
    """The causal LM's config as a one-label sequence classifier's (architectures, pad token)."""
    import copy

    from transformers import AutoModelForSequenceClassification

    seq = copy.deepcopy(config)
    seq.num_labels = 1
    seq.pad_token_id = pad_token_id
    seq.get_text_config().pad_token_id = pad_token_id
    seq.tie_word_embeddings = False
    seq.use_cache = False
    try:
        cls = AutoModelForSequenceClassification._model_mapping[type(config)]
    except KeyError:
        raise UserError(f"method=rm: transformers has no sequence classifier for {type(config).__name__}; "
                        "the reward model cannot be exported as one") from None
    seq.architectures = [cls.__name__]
    return seq, cls


def to_sequence_classifier(decoder_lm: nn.Module, head_weight: torch.Tensor, pad_token_id: int,
                           dtype: torch.dtype) -> nn.Module:
    """A transformers *ForSequenceClassification with `decoder_lm`'s decoder (a plain causal LM,
    adapters merged) and `head_weight` (1 x hidden) as `score`, in `dtype`."""
    config, cls = sequence_classifier_config(decoder_lm.config, pad_token_id)
    with torch.device("meta"):
        seq = cls(config)
    state = {f"model.{k}": v for k, v in decoder_lm.model.state_dict().items()}
    state["score.weight"] = head_weight.detach().reshape(1, -1).clone()
    seq.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()},
                        strict=True, assign=True)
    # Buffers built in __init__ (RoPE's inv_freq) are not in the state dict: the causal LM's own,
    # under the same names (both keep the decoder at `.model`)
    own = dict(decoder_lm.named_buffers())
    for name, buf in list(seq.named_buffers()):
        if buf.is_meta:
            mod_name, _, leaf = name.rpartition(".")
            seq.get_submodule(mod_name).register_buffer(leaf, own[name].clone(), persistent=False)
    cast_weights(seq, dtype)
    seq.eval()
    return seq

