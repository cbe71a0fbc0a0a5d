"""What a run is and whether it may run: the schemas (schema.py), the conf/ files (files.py),
validation of a composed config (validate.py), the compatibility rules (rules.py), the resolved
run (resolved.py) and preflight (preflight.py)."""
