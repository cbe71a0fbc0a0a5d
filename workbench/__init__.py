"""workbench: fine-tuning and alignment on one runner (SFT, LoRA/QLoRA, DPO, GRPO), composed with Hydra."""

__version__ = "0.1.0"
