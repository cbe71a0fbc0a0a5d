"""A config resolved into a run: validation (`validate.py`) and the settings with no effect
(`no_effect.py`), the derived decisions (`derive.py`), the rule table (`rules.py`), and the
resolved run every rank reads (`resolved.py`)."""
