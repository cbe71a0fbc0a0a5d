"""Environments for multi-turn GRPO episodes (`env=<name>`): the interface and the shipped ones."""
