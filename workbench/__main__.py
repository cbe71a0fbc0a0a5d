"""`python -m workbench ...`: see workbench/cli.py."""

from workbench.cli import main

main()
