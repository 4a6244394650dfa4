"""What the benchmark asks of each system: scenarios as data, one line each.

A scenario names the prompts (chat prompts built from a fixed list of topics, distinct for
every index) and how many new tokens each stream generates, greedy. ``chat`` is the default
and the README's table: ``prompt(i)`` is the same text it always was and ``max_tokens`` is 48.
A new scenario is a new entry in ``SCENARIOS``; the systems need nothing else.

A level of ``clients`` streams sends ``streams(clients, offset)``: one request a client, all at
once, and for a scenario with a ``late`` group (``mixed``) that group's clients too, each sent
once every stream of the first group has its first token (or has ended): long prompts arriving
while short streams decode. ``unique`` prompts differ from their first words, so that no
prompt cache (the servers keep theirs on) can serve one prompt's prefix to another.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

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
# The unique contexts' sentences: each prompt cycles through them from its own topic on.
UNIQUE_SENTENCES = (
    "Note {n} of document {index}: {topic} have a long history.",
    "People in many places have written about {topic} for centuries.",
    "Some of those writings describe {topic} in great detail, season by season.",
    "Others compare {topic} with {other}, and ask which one changed more.",
)


LONG_CONTEXT_SENTENCES = 70  # about 1,000 tokens with the chat template (tests/test_bench.py)
# About 2,000 bytes: 2,000 tokens of the GPU run's byte-level tokenizer (api/bench/models.py).
GPU_CONTEXT_SENTENCES = 30
# Long prompts arriving in the mixed scenario: one for every 4 streams, at least 4 (8 streams
# on CPU: 4, as design/017 measured; 64 on a GPU: 16, as issue 23 asks).
MIXED_LATE = 4
MIXED_LATE_SHARE = 4


def prompt(index: int) -> str:
    """The ``index``-th chat prompt of the fixed list (distinct for every index)."""
    return f"Write a short paragraph about {TOPICS[index % len(TOPICS)]} (#{index})."


def unique_context(index: int, sentences: int) -> str:
    """``sentences`` background sentences that start with ``index``'s own words."""
    lines = []
    for n in range(sentences):
        topic = TOPICS[(index + n) % len(TOPICS)]
        other = TOPICS[(index + 3 * n + 1) % len(TOPICS)]
        template = UNIQUE_SENTENCES[n % len(UNIQUE_SENTENCES)]
        lines.append(template.format(n=n + 1, index=index, topic=topic, other=other))
    return " ".join(lines) + " "


@dataclass(frozen=True, slots=True)
class Stream:
    """One client's request: its prompt and new tokens; ``late``: sent once every stream
    of the first group has its first token or has ended."""

    prompt: str
    max_tokens: int
    late: bool = False

    def to_json(self) -> dict[str, object]:
        return {"prompt": self.prompt, "max_tokens": self.max_tokens, "late": self.late}


@dataclass(frozen=True, slots=True)
class Scenario:
    """One workload: the prompts each stream sends and the new tokens it generates.

    ``context_sentences``: how many background sentences go before the question (0: the plain
    chat prompt), so a scenario can be prefill-heavy without a new prompt list; ``unique``:
    those sentences differ from prompt to prompt from the first word (``unique_context``).
    ``late``: the scenario whose prompts more clients send once every stream of this one has
    its first token (see the module docstring): one for every ``late_share`` streams, at least
    ``late_clients``. ``levels``: the levels to run
    it at (none: the run's, ``--concurrency``).
    """

    name: str
    max_tokens: int
    context_sentences: int = 0
    description: str = ""
    unique: bool = False
    late: Scenario | None = None
    late_clients: int = 0
    late_share: int = 0
    levels: tuple[int, ...] = ()

    def prompt(self, index: int) -> str:
        if self.unique:
            return unique_context(index, self.context_sentences) + prompt(index)
        topic = TOPICS[index % len(TOPICS)]
        return CONTEXT_SENTENCE.format(topic=topic) * self.context_sentences + prompt(index)

    def num_streams(self, clients: int) -> int:
        """Streams at a level of ``clients``: those clients, and the late ones."""
        return clients + self.num_late(clients)

    def num_late(self, clients: int) -> int:
        """The late streams at a level of ``clients``."""
        if self.late is None:
            return 0
        share = clients // self.late_share if self.late_share > 0 else 0
        return max(self.late_clients, share)

    def streams(self, clients: int, offset: int) -> list[Stream]:
        """A level's streams: ``clients`` of this scenario's prompts from ``offset`` on, then
        the late ones, with the prompts that follow."""
        first = [Stream(self.prompt(offset + i), self.max_tokens) for i in range(clients)]
        if self.late is None:
            return first
        late = self.late
        return first + [
            Stream(late.prompt(offset + clients + i), late.max_tokens, late=True)
            for i in range(self.num_late(clients))
        ]

    def with_max_tokens(self, max_tokens: int | None) -> Scenario:
        """This scenario with ``max_tokens`` new tokens per stream, late ones included (None:
        unchanged)."""
        if max_tokens is None or max_tokens == self.max_tokens:
            return self
        late = self.late.with_max_tokens(max_tokens) if self.late is not None else None
        return replace(self, max_tokens=max_tokens, late=late)


DEFAULT_SCENARIO = "chat"
LONG_CONTEXT = Scenario(
    "long-context",
    64,
    LONG_CONTEXT_SENTENCES,
    "a unique prompt of about 1,000 tokens a stream: no cache helps",
    unique=True,
)
SCENARIOS = {
    s.name: s
    for s in (
        Scenario("chat", 48, description="a one-line chat prompt (the README's)"),
        Scenario("long-prompt", 16, 40, "about 600 prompt tokens: prefill-heavy"),
        LONG_CONTEXT,
        Scenario(
            "long-context-gpu",
            64,
            GPU_CONTEXT_SENTENCES,
            "a unique prompt of about 2,000 characters a stream: about 2,000 tokens of "
            "the GPU run's model (its tokenizer is byte-level; issue 23's H200 load)",
            unique=True,
        ),
        Scenario(
            "mixed",
            128,
            description="chat prompts streaming; once all stream, long-context prompts arrive, "
            f"one for every {MIXED_LATE_SHARE} streams, at least {MIXED_LATE}",
            late=LONG_CONTEXT,
            late_clients=MIXED_LATE,
            late_share=MIXED_LATE_SHARE,
        ),
    )
}


def parse_scenarios(text: str) -> list[Scenario]:
    """Comma-separated scenario names, in the order given, each with its own levels if it
    says (``long-context:8``, ``chat:1+32``; else ``--concurrency``'s); ValueError names the
    known ones."""
    chosen: dict[str, set[int]] = {}
    for item in (n.strip() for n in text.split(",")):
        if not item:
            continue
        name, _, levels = item.partition(":")
        try:
            counts = {int(x) for x in levels.split("+")} if levels else set()
        except ValueError:
            raise ValueError(f"not levels joined by '+': {levels!r} (as in chat:1+32)") from None
        if any(c < 1 for c in counts):
            raise ValueError(f"levels must be at least 1: {item!r}")
        chosen.setdefault(name.strip(), set()).update(counts)
    if not chosen:
        raise ValueError("at least one scenario")
    if unknown := [n for n in chosen if n not in SCENARIOS]:
        raise ValueError(f"unknown scenario {unknown}; choose from {', '.join(SCENARIOS)}")
    return [replace(SCENARIOS[n], levels=tuple(sorted(c))) for n, c in chosen.items()]


def names(scenarios: Sequence[Scenario]) -> str:
    return ",".join(s.name for s in scenarios)
