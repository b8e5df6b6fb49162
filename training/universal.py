"""`python -m training.universal`: convert a DeepSpeed checkpoint to the universal format (training/checkpoints/universal.py)."""

import sys

from training.checkpoints.universal import main

if __name__ == "__main__":
    sys.exit(main())
