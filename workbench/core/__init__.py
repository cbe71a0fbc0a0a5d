"""The foundation every other package stands on: user errors (errors.py), import helpers that keep
optional engines out until chosen (imports.py), the start-up collector pause (startup.py), the
cache directory with one writer per entry (cache.py)."""
