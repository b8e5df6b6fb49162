"""`python -m training.memory_plan`: what one rank will hold, and the cheapest config that fits (training/memory/plan.py)."""

import sys

from training.memory.plan import main

if __name__ == "__main__":
    sys.exit(main())
