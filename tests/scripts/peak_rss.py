"""Peak resident memory of one of the repo's commands, run in this process.

    python tests/scripts/peak_rss.py OUT.json MODULE [ARGS...]

Imports MODULE (`training.export`, ...), notes the resident set, runs its `main(ARGS)`, and
writes to OUT.json {"imported": bytes, "peak": the kernel's peak resident set of the whole
process (VmHWM, as getrusage's ru_maxrss reports it: no spike is missed), "code": main's
return}."""

import importlib
import json
import os
import resource
import sys
from pathlib import Path


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


if __name__ == "__main__":
    out, module, *args = sys.argv[1:]
    main = importlib.import_module(module).main
    imported = rss()
    code = main(args)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(out).write_text(json.dumps({"imported": imported, "peak": peak, "code": code}))
    sys.exit(code or 0)
