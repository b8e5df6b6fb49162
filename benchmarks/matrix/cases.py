"""The compatibility matrix as cases: matrix.yaml's axes, every combination of their values, the
refusal rule or the reference each is held to, and a pairwise cover (every pair of values of
any two axes in at least one case) for CI."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import yaml

MATRIX = Path(__file__).with_name("matrix.yaml")


@dataclass(frozen=True)
class Rule:
    """A refusal: the combinations whose values match `when` (axis -> allowed values) must be
    refused in one line that contains `says`."""

    when: dict[str, tuple[str, ...]]
    says: str

    def matches(self, case: dict[str, str]) -> bool:
        return all(case[axis] in values for axis, values in self.when.items())


@dataclass(frozen=True)
class Matrix:
    """matrix.yaml read and checked: axes (axis -> value -> its piece of the command), the
    reference, the bounds and the refusal rules."""

    raw: dict

    @classmethod
    def load(cls, path: Path = MATRIX) -> Matrix:
        matrix = cls(yaml.safe_load(Path(path).read_text()))
        matrix.check()
        return matrix

    @property
    def axes(self) -> dict[str, dict[str, dict]]:
        return {axis: {str(k): v or {} for k, v in values.items()}
                for axis, values in self.raw["axes"].items()}  # fmt: skip

    @cached_property
    def rules(self) -> tuple[Rule, ...]:
        out = []
        for rule in self.raw.get("refusals") or []:
            when = {
                a: tuple(map(str, v if isinstance(v, list) else [v]))
                for a, v in rule["when"].items()
            }
            out.append(Rule(when, rule["says"]))
        return tuple(out)

    def check(self) -> None:
        """Every rule and resume target names axes and values the matrix has."""
        axes = self.axes
        for rule in self.rules:
            for axis, values in rule.when.items():
                unknown = set(values) - set(axes.get(axis, {}))
                if axis not in axes or unknown:
                    raise ValueError(f"{MATRIX.name}: rule {rule.says!r}: {axis} {sorted(unknown)}")
        for kind, targets in self.raw["resume_on"].items():
            if set(targets) != set(axes["layout"]) or not set(targets.values()) <= set(
                axes["layout"]
            ):
                raise ValueError(f"{MATRIX.name}: resume_on.{kind} must map every layout")

    def all_cases(self) -> list[dict[str, str]]:
        """Every combination of the axes' values, in the file's order."""
        names = list(self.axes)
        return [dict(zip(names, combo, strict=True))
                for combo in itertools.product(*(self.axes[a] for a in names))]  # fmt: skip

    def refusals(self, case: dict[str, str]) -> list[Rule]:
        """The rules that refuse `case` (its refusal may name any one of their pairs); none
        when it must train to its reference."""
        return [r for r in self.rules if r.matches(case)]

    def refusal(self, case: dict[str, str]) -> Rule | None:
        """The first rule that refuses `case`, or None when it must train to its reference."""
        return next(iter(self.refusals(case)), None)

    def bound(self, case: dict[str, str]) -> float:
        muon = case.get("optimizer") == "muon" and "bounds_muon" in self.raw
        return float(self.raw["bounds_muon" if muon else "bounds"][case["precision"]])


def pairwise(matrix: Matrix, axes: dict[str, list[str]] | None = None) -> list[dict[str, str]]:
    """A small set of cases in which every pair of values of any two axes occurs together at
    least once among the cases no rule refuses, plus, for each refusal rule, one case it refuses
    (greedy, deterministic). `axes` narrows the values taken (default: all)."""
    values = axes or {a: list(v) for a, v in matrix.axes.items()}
    names = list(values)
    every = [(c, matrix.refusal(c)) for c in _product(values)]
    trainable = [c for c, rule in every if rule is None]
    held = [_pairs(c, names) for c in trainable]
    wanted = set().union(*held)
    chosen: list[dict[str, str]] = []
    while wanted:
        best = max(range(len(trainable)), key=lambda i: len(held[i] & wanted))
        chosen.append(trainable[best])
        wanted -= held[best]
    for rule in matrix.rules:
        hit = next((c for c, first in every if first is rule), None)
        if hit is not None:
            chosen.append(hit)
    return chosen


def _product(values: dict[str, list[str]]) -> list[dict[str, str]]:
    names = list(values)
    return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*values.values())]


def _pairs(case: dict[str, str], names: list[str]) -> set[tuple[str, str, str, str]]:
    return {(a, case[a], b, case[b]) for a, b in itertools.combinations(names, 2)}


def case_id(case: dict[str, str]) -> str:
    """A case's name: its values in axis order, e.g. zero3-dpo-moe-off-fp32-plain-world."""
    return "-".join(case.values())
