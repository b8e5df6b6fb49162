"""The command `python -m training.memory_plan`: what one rank will hold, and the cheapest config
that fits. The library is training/memory/plan.py; this file only runs its `main`."""

import sys

from training.memory.plan import main

if __name__ == "__main__":
    sys.exit(main())
