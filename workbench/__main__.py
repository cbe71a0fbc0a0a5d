"""`python -m workbench ...`: see workbench/cli.py."""

from workbench import startup

startup.pause()  # before the imports: workbench/startup.py

from workbench.cli import main  # noqa: E402

main()
