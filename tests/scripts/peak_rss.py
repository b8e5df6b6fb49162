"""Peak resident memory of one of the repo's commands, run in this process.

    python tests/scripts/peak_rss.py OUT.json MODULE [ARGS...]

Imports MODULE (`training.export`, ...), notes the resident set, runs its `main(ARGS)`, and
writes to OUT.json {"imported": bytes, "peak": the kernel's peak for the whole process,
"imported_anon" and "peak_anon": the same for anonymous memory only (what the process itself
holds, without the pages of files it maps, which the kernel may take back at any time; sampled
every 5 ms, so a shorter spike is missed), "code": main's return}."""

import importlib
import json
import os
import resource
import sys
import threading
import time
from pathlib import Path


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def anon() -> int:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024


class AnonPeak(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.done = anon(), threading.Event()

    def run(self):
        while not self.done.is_set():
            self.peak = max(self.peak, anon())
            time.sleep(0.005)


if __name__ == "__main__":
    out, module, *args = sys.argv[1:]
    main = importlib.import_module(module).main
    imported, imported_anon = rss(), anon()
    sampler = AnonPeak()
    sampler.start()
    code = main(args)
    sampler.done.set()
    sampler.join()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = {"imported": imported, "peak": peak, "code": code}
    result.update(imported_anon=imported_anon, peak_anon=max(sampler.peak, anon()))
    Path(out).write_text(json.dumps(result))
    sys.exit(code or 0)
