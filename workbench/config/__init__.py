"""What a config is: the schemas (schema.py) and the conf/ files (files.py). What a composed config
resolves to, and whether it may run, is workbench/run/."""
