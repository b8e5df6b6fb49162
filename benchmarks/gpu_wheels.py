"""What a lent GPU machine lacks of zerostack's dependencies, as data: the wheels
benchmarks/gpu_wheels.sh downloads here (versions from requirements.lock), what the machine's
image already has, and what is left out on purpose with the reason.

    python -m benchmarks.gpu_wheels binary    # NAME==VERSION of each wheel with compiled code
    python -m benchmarks.gpu_wheels pure      # NAME==VERSION of each pure-Python wheel
    python -m benchmarks.gpu_wheels built     # NAME==VERSION of each wheel built here from an sdist
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# The GPU image (Python 3.12, torch 2.11+cu130, transformers 5.17): distributions installed
# there, with what they pull in (transformers' and torch's own requirements).
IMAGE_HAS = (
    "torch",
    "transformers",
    "accelerate",
    "peft",
    "safetensors",
    "sentencepiece",
    "tokenizers",
    "pyarrow",
    "numpy",
    "psutil",
    "tensorboard",
    "pyyaml",
    "matplotlib",
    "huggingface_hub",
    "tqdm",
    "packaging",
    "filelock",
    "regex",
    "requests",
    "typing_extensions",
    "jinja2",
    "setuptools",
)
# Wheels with compiled code, downloaded for cp312 manylinux x86_64.
BINARY = ("pydantic_core", "msgpack", "ninja")
# Pure-Python wheels (py3-none-any).
PURE = ("pydantic", "annotated-types", "typing-inspection", "hjson", "py-cpuinfo", "einops")
# PyPI has only an sdist: built here into a wheel, its ops left to build on first use there.
BUILT = ("deepspeed",)
# Imported by training/, models/ or data/ but not carried, and why the check runs without them.
LEFT_OUT = {
    "lm_eval": "its closure (datasets, evaluate, pandas, scipy, lxml, sacrebleu, ...) is over "
    "40 MiB; the evaluation row is skipped",
    "datasets": "read only for hub datasets and parquet files; the check prepares pystdlib",
    "wandb": "only with --wandb",
}
# Import names whose distribution is spelled otherwise.
IMPORT_NAMES = {"yaml": "pyyaml", "cpuinfo": "py-cpuinfo", "annotated_types": "annotated-types"}


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them: lower case, runs of -_. as one -."""
    return re.sub(r"[-_.]+", "-", name).lower()


def locked_versions(lock: Path = REPO / "requirements.lock") -> dict[str, str]:
    """{normalized name: version} of every `NAME==VERSION` line of the lock file."""
    out = {}
    for line in lock.read_text().splitlines():
        name, sep, version = line.strip().partition("==")
        if sep and not line.startswith("#"):
            out[normalize(name)] = version
    return out


def pinned(names: tuple[str, ...], versions: dict[str, str] | None = None) -> list[str]:
    """NAME==VERSION for each name, at the lock file's version (a KeyError names a missing one)."""
    versions = locked_versions() if versions is None else versions
    return [f"{n}=={versions[normalize(n)]}" for n in names]


def carried() -> set[str]:
    """Normalized names of everything the GPU machine gets: its image's and the wheels'."""
    return {normalize(n) for n in (*IMAGE_HAS, *BINARY, *PURE, *BUILT)}


if __name__ == "__main__":
    kind = {"binary": BINARY, "pure": PURE, "built": BUILT}[sys.argv[1]]
    print("\n".join(pinned(kind)))
