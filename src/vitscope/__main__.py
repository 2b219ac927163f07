"""`python -m vitscope ...` (and `torchrun -m vitscope train ...`)."""

import sys

from vitscope.console import main

sys.exit(main())
