"""The command `python -m training.export`: export a checkpoint to a folder stock transformers
loads. The library is training/checkpoints/hf_export.py; this file only runs its `main`."""

import sys

from training.checkpoints.hf_export import main

if __name__ == "__main__":
    sys.exit(main())
