"""`python -m training.export`: export a checkpoint to a folder stock transformers loads (training/checkpoints/export.py)."""

import sys

from training.checkpoints.export import main

if __name__ == "__main__":
    sys.exit(main())
