"""The report of a chaos run: the invariants' verdict (``ok``) and the tables the CLI prints
(each fault kind planned against injected, the outcomes, what each invariant found)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from .invariants import Check
from .results import RunResult


@dataclass(frozen=True, slots=True)
class ChaosReport:
    """A run and what each invariant found in it."""

    run: RunResult
    checks: list[Check]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def table(self) -> str:
        plan, run = self.run.plan, self.run
        lines = [
            f"seed {plan.seed}: {len(plan.requests)} requests, {run.client}",
            "",
            "| fault | planned | injected |",
            "| --- | --- | --- |",
        ]
        injected = run.injected
        for kind in sorted(set(plan.planned) | {k for k, v in injected.items() if v}):
            lines.append(f"| {kind} | {plan.planned[kind]} | {injected[kind]} |")
        outcomes = Counter(r.outcome for r in run.requests if r.outcome is not None)
        outcomes.update(f"refused:{r.refused}" for r in run.requests if r.refused)
        outcomes["unseen (client hung up)"] = sum(r.unseen for r in run.requests)
        outcomes["truncated (stream cut)"] = sum(r.truncated for r in run.requests)
        lines += ["", "| outcome | requests |", "| --- | --- |"]
        lines += [f"| {kind} | {n} |" for kind, n in sorted(outcomes.items()) if n]
        lines += ["", "| invariant | holds | detail |", "| --- | --- | --- |"]
        lines += [f"| {c.name} | {'yes' if c.ok else 'NO'} | {c.detail} |" for c in self.checks]
        return "\n".join(lines)
