"""What the benchmark asks of each system: scenarios as data, one line each.

A scenario names the prompts (chat prompts built from a fixed list of topics, distinct for
every index) and how many new tokens each stream generates, greedy. ``chat`` is the default
and the README's table: ``prompt(i)`` is the same text it always was and ``max_tokens`` is 48.
A new scenario is a new entry in ``SCENARIOS``; the systems need nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

TOPICS = (
    "rivers",
    "mountains",
    "the moon",
    "bicycles",
    "coffee",
    "libraries",
    "volcanoes",
    "owls",
    "trains",
    "gardens",
    "the ocean",
    "clocks",
    "bread",
    "snow",
    "bridges",
    "music",
)
CONTEXT_SENTENCE = "Here is some background you may use: {topic} have a long history. "


def prompt(index: int) -> str:
    """The ``index``-th chat prompt of the fixed list (distinct for every index)."""
    return f"Write a short paragraph about {TOPICS[index % len(TOPICS)]} (#{index})."


@dataclass(frozen=True, slots=True)
class Scenario:
    """One workload: the prompts each stream sends and the new tokens it generates.

    ``context_sentences``: how many background sentences go before the question (0: the plain
    chat prompt), so a scenario can be prefill-heavy without a new prompt list.
    """

    name: str
    max_tokens: int
    context_sentences: int = 0
    description: str = ""

    def prompt(self, index: int) -> str:
        topic = TOPICS[index % len(TOPICS)]
        return CONTEXT_SENTENCE.format(topic=topic) * self.context_sentences + prompt(index)

    def with_max_tokens(self, max_tokens: int | None) -> Scenario:
        """This scenario with ``max_tokens`` new tokens per stream (None: unchanged)."""
        if max_tokens is None or max_tokens == self.max_tokens:
            return self
        return Scenario(self.name, max_tokens, self.context_sentences, self.description)


DEFAULT_SCENARIO = "chat"
SCENARIOS = {
    s.name: s
    for s in (
        Scenario("chat", 48, description="a one-line chat prompt, 48 new tokens (the README's)"),
        Scenario("long-prompt", 16, 40, "about 600 prompt tokens, 16 new: prefill-heavy"),
    )
}


def parse_scenarios(text: str) -> list[Scenario]:
    """Comma-separated scenario names, in the order given; ValueError names the known ones."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError("at least one scenario")
    if unknown := [n for n in names if n not in SCENARIOS]:
        raise ValueError(f"unknown scenario {unknown}; choose from {', '.join(SCENARIOS)}")
    return [SCENARIOS[n] for n in dict.fromkeys(names)]


def names(scenarios: Sequence[Scenario]) -> str:
    return ",".join(s.name for s in scenarios)
