"""Model families: one module per family holding what every path needs to know of it (its HF
model type, GGUF architecture and tensor rules, tokenizer and chat template, the Megatron mapping
or its absence), and `registry.py`, the only list of them. A family none of them describes still
trains through transformers' own classes; it has no GGUF export and no Megatron mapping."""
