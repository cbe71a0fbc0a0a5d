"""`python -m workbench ...`: see workbench/cli.py."""

from workbench.core import startup

startup.pause()  # before the imports: workbench/core/startup.py

from workbench.cli import main  # noqa: E402

main()
