"""python -m benchmarks.matrix: run the compatibility matrix and render docs/compatibility.md.

    python -m benchmarks.matrix                  # the pairwise cover (what CI runs), then render
    python -m benchmarks.matrix --cases all      # every combination of matrix.yaml
    python -m benchmarks.matrix --cases zero3-dpo-moe-off-fp32-plain-none ...
    python -m benchmarks.matrix --render         # only render the committed results

Results go to benchmarks/results/compatibility.json (merged by case); each case's runs under
--work. Exit 1 when any case is a bug."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.host import host_class
from benchmarks.matrix.cases import Matrix, case_id, pairwise
from benchmarks.matrix.render import DOC, RESULTS, render
from benchmarks.matrix.runner import Runner, merge
from benchmarks.provenance import today


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", nargs="*", default=["pairwise"], help="pairwise, all, or case ids")
    p.add_argument("--work", default="runs/matrix", help="folder for the inputs and the runs")
    p.add_argument("--results", default=str(RESULTS))
    p.add_argument("--render", action="store_true", help="only render docs/compatibility.md")
    args = p.parse_args(argv)
    matrix = Matrix.load()
    if not args.render:
        cases = select(matrix, args.cases)
        runner = Runner(matrix, Path(args.work))
        host = host_class()
        for i, case in enumerate(cases, 1):
            result = runner.run(case)
            merge(Path(args.results), [result], host, today())  # kept as it goes
            said = result.get("why") or result.get("refusal") or f"gap {result.get('gap'):.1e}"
            print(f"[{i}/{len(cases)}] {result['id']}: {result['outcome']} ({said})", flush=True)
    Path(DOC).write_text(render(matrix, Path(args.results)))
    print(f"wrote {DOC}")
    bugs = [r for r in read_results(Path(args.results)) if r["outcome"] == "bug"]
    return 1 if bugs else 0


def select(matrix: Matrix, names: list[str]) -> list[dict[str, str]]:
    if names == ["pairwise"]:
        return pairwise(matrix)
    if names == ["all"]:
        return matrix.all_cases()
    by_id = {case_id(c): c for c in matrix.all_cases()}
    unknown = [n for n in names if n not in by_id]
    if unknown:
        sys.exit(f"error: no such case: {', '.join(unknown)}")
    return [by_id[n] for n in names]


def read_results(path: Path) -> list[dict]:
    import json

    return json.loads(path.read_text())["cases"] if path.is_file() else []


if __name__ == "__main__":
    sys.exit(main())
