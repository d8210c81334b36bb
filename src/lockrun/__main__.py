"""``python -m lockrun``."""

from lockrun.cli import main

main()
