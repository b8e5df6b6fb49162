"""Runs training/train.py with one checkpoint save held open, so a test can kill it mid-save.

    ZEROSTACK_TEST_HOLD_SAVE=4:60   hold the save of step 4 for 60 s

Rank 0 waits after the step's files and trainer state are written and before the listing that
seals the checkpoint (complete.json) and moves `latest`. Never used outside tests."""

import os
import time

from training import train
from training.checkpoints import integrity, layout

step, seconds = os.environ["ZEROSTACK_TEST_HOLD_SAVE"].split(":")
listing = integrity.listing


def held_listing(folder, *args, **kwargs):
    if folder.name == layout.tag_for(int(step)) and os.environ.get("RANK", "0") == "0":
        print(f"[test hook] holding save of {folder.name} open", flush=True)
        time.sleep(float(seconds))
    return listing(folder, *args, **kwargs)


integrity.listing = held_listing
train.distributed.exit_process(train.main())
