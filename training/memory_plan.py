"""The command `python -m training.memory_plan`: what one rank will hold, and the cheapest config
that fits. The library is training/memory/ (the command: plan_command.py); this file only runs its `main`."""

import sys

from training.memory.plan_command import main

if __name__ == "__main__":
    sys.exit(main())
