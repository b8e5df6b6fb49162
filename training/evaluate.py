"""The command `python -m training.evaluate`: lm-evaluation-harness on a run's checkpoint or a
model folder. The library is training/evaluation/; this file only runs its `main`."""

import sys

from training.evaluation.command import main

if __name__ == "__main__":
    sys.exit(main())
