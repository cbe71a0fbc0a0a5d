"""The planner: will this run fit, where, how fast and for how much - before any weights load.

    python -m workbench dry_run=true method=dpo model=70b                 # rich table
    python -m workbench dry_run=true model=70b plan.json=true             # JSON for tools
    python -m workbench dry_run=true model=70b plan.mfu=0.35 plan.tokens=1e9
    python -m workbench dry_run=true model=70b plan.compare=true          # every profile in the table
    python -m workbench dry_run=trace method=dpo model=70b backend=fsdp2 hardware=8xh100   # + the step on fake tensors

`workbench/plan/make.py` (`make_plan(cfg)`) counts parameters exactly on a meta-device probe (counts.py), estimates
per-device memory term by term (memory.py), gives a verdict for the configured hardware and
every profile in conf/hardware/ with the smallest change that fits (fit.py), and the time and
cost of the whole job on all of a profile's devices at plan.mfu, with a rollout method's
generation timed apart (speed.py). The table shows the configured hardware; plan.compare=true
lists the other profiles too. A dry run whose plan does not fit the configured hardware exits 4
after printing it, its `error:` line ending with the smallest change that fits.
"""
