"""`python -m tokenloop.cli ...`: the same command line as the `tokenloop` script."""

from tokenloop.cli.main import main

raise SystemExit(main())
