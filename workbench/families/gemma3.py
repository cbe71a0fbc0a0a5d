"""Gemma 3 (its text model, `gemma3_text`): RMSNorm by 1 + w, a sliding window on five of six
layers, a SentencePiece vocabulary with byte fallback, and Gemma's turn template; no Megatron
mapping."""

from workbench.families.spec import FamilySpec, Gguf

# Gemma's turn format (its instruction-tuned models' template): a system turn folded into the first
# user turn, the assistant's role `model`, every turn ending in <end_of_turn>. The base model's
# GGUF carries no template; fine-tuning it on chats teaches it this one, the format Gemma's tooling
# serves (also data.chat_template=gemma). No `trim`: what a turn trains on is exactly its content
# (workbench/data/chat.py).
TEMPLATE = (
    "{{ bos_token }}"
    "{% set system = messages[0]['content'] + '\n\n' if messages and messages[0]['role'] == 'system' else '' %}"
    "{% for message in messages if message['role'] != 'system' %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (system if loop.first else '') + message['content'] + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

SPEC = FamilySpec(
    model_type="gemma3_text", aliases=("gemma", "gemma2", "gemma3"),
    gguf=Gguf(arch="gemma3", norm_plus_one=True, sliding_window=True, query_scale_from_head_dim=True),
    tokenizer_class="GemmaTokenizer", chat_template=TEMPLATE, template_name="gemma",
    qk_norm=True, norms_per_block=4, norm_in_fp32=True,
)
