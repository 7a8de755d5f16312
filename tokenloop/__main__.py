"""`python -m tokenloop ...`: the same command line as the `tokenloop` script."""

from tokenloop.cli import main

raise SystemExit(main())
