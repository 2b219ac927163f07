"""`python -m vitscope ...` (and `torchrun -m vitscope train ...`)."""

import sys

from vitscope.cli import main

sys.exit(main())
