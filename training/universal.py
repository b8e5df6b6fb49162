"""The command `python -m training.universal`: convert a DeepSpeed checkpoint to the universal
format. The library is training/checkpoints/universal_copy.py; this file only runs its `main`."""

import sys

from training.checkpoints.universal_copy import main

if __name__ == "__main__":
    sys.exit(main())
