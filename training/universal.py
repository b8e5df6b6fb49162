"""The command `python -m training.universal`: convert a DeepSpeed checkpoint to the universal
format. The library is training/checkpoints/universal.py; this file only runs its `main`."""

import sys

from training.checkpoints.universal import main

if __name__ == "__main__":
    sys.exit(main())
