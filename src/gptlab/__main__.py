"""`python -m gptlab` runs the command line (also what `torchrun -m gptlab` launches)."""

from gptlab.cli import main

raise SystemExit(main())
