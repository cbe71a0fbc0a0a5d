"""What observes and records a run: metrics.jsonl and MFU (metrics.py), the trackers
(trackers.py), the progress bar (progress.py), plots (plots.py), FLOPs as computed (flops.py),
the manifest (manifest.py) and the report (report.py)."""
