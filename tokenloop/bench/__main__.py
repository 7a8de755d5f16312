"""`python -m tokenloop.bench serve | make-trace | policies`: the benchmark commands standalone."""

from tokenloop.bench.cli import main

raise SystemExit(main())
