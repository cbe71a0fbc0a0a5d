"""What a run leaves to use: the adapter and merged folders (write.py), GGUF files (gguf.py), the
parity gate every export passes (parity.py), the Hub upload (hub.py);
`python -m workbench.export <run_dir>` exports a checkpoint again (__main__.py)."""
