"""A run, assembled and driven: validation of a composed config (validate.py), the compatibility
rules (rules.py), the run's derived decisions (derive.py) and their resolution (resolved.py),
the plan (plan.py), preflight (preflight.py), the data previews (preview.py, preview_rows.py)
and the runner (runner.py). Everything here sits above the parts it assembles: nothing below
imports this package."""
