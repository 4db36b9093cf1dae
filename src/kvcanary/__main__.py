"""``python -m kvcanary``: the ``kv-canary`` command line."""

from kvcanary.cli import main

main()
