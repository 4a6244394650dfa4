"""The suite's plan: which system runs which scenario's level in which round, and in what order.

Data, no processes: the runner (``runner``) walks it; the tests read it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .scenarios import Scenario
from .systems import SYSTEMS, WARMUP_BURSTS, WARMUP_CLIENTS


@dataclass(frozen=True, slots=True)
class Run:
    """One system loaded once: a scenario's level in one round, with its prompts from
    ``prompt_offset`` on (the same for every system of that level and round)."""

    scenario: Scenario
    clients: int
    key: str
    round: int
    prompt_offset: int


def plan(
    scenarios: Sequence[Scenario], keys: Sequence[str], levels: Sequence[int], rounds: int = 1
) -> list[Run]:
    """The runs in order: scenarios in turn, levels ascending in each (the scenario's own, else
    ``levels``), ``rounds`` rounds of a level in a row, the systems' order rotating from round
    to round and level to level (single-stream systems at level 1 only, and never in a scenario
    with late streams).

    Every level and round gets prompts of its own, after the warm-up's, so that no prompt is
    sent twice to a server (whose prompt cache would serve it)."""
    runs = []
    offset = WARMUP_CLIENTS * WARMUP_BURSTS
    for scenario in scenarios:
        for i, clients in enumerate(scenario.levels or levels):
            for r in range(rounds):
                turn = (i * rounds + r) % len(keys)
                order = list(keys[turn:]) + list(keys[:turn])
                runs.extend(
                    Run(scenario, clients, k, r, offset)
                    for k in order
                    if not SYSTEMS[k].is_single_stream or (clients == 1 and scenario.late is None)
                )
                offset += scenario.num_streams(clients)
    return runs


def scenario_settings(scenario: Scenario) -> dict:
    """A scenario as the JSON records it."""
    out = {
        "name": scenario.name,
        "max_tokens": scenario.max_tokens,
        "context_sentences": scenario.context_sentences,
        "unique": scenario.unique,
        "description": scenario.description,
        "levels": list(scenario.levels),
    }
    if scenario.late is not None:
        out["late"] = {
            **scenario_settings(scenario.late),
            "clients": scenario.late_clients,
            "share": scenario.late_share,
        }
    return out
