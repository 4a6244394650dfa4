"""Speculative decoding, paired in one run: plain and prompt-lookup steps on the serial lane
(``Engine.generate``, no runtime), one stream, greedy, rounds interleaved.

Two prompts: a copy-heavy one (rewrite a given ~300-word text with one word changed: the
output repeats the prompt) and free text (a story: drafts rarely match). Each round runs both
ways and prints decode tok/s, the ratio, the tokens drafted and accepted, and whether the
greedy texts are identical; the last line per prompt is the median ratio.

    python -m bench.speculative                      # the default model on this machine
    python -m bench.speculative --only equality      # greedy text identical? 10 prompts
    python -m bench.speculative --verify-cost --shape 8b --device gpu   # the cost model

``--verify-cost`` measures what a verify step costs: one forward of 1 + k tokens over a KV
cache of ``--context`` tokens, against a forward of one token, on random weights of
``--shape`` (``api/bench/models.py``'s 1B or 8B Llama shapes; random weights accept nothing,
so the figure is the cost model: speculation pays when accepted tokens a step exceed the
ratio). design/032-speculative.md has the figures.
"""

from __future__ import annotations

import argparse
import statistics
import time

from mlx_trio.engine.generate import Engine
from mlx_trio.engine.params import PreparedRequest, SamplingParams, Speculation
from mlx_trio.engine.speculative.plan import DEFAULT_NUM_DRAFT_TOKENS

TEXT = (
    "The harbor town woke slowly on winter mornings. Fishermen walked down to the boats before "
    "the sun cleared the hills, their breath hanging in the cold air, and the baker on the "
    "corner opened his shutters to let the smell of bread drift across the square. Children "
    "ran to school along the sea wall, counting the gulls that sat on the posts, and the old "
    "ferry sounded its horn twice as it left for the island. By nine the market was busy. "
    "Farmers from the valley sold apples, cheese and honey from wooden carts, and the woman "
    "who kept the bookshop set out a table of secondhand novels under a striped awning. The "
    "harbor master walked the length of the quay with a notebook, writing down which boats "
    "had gone out and which had stayed in, because the weather report had warned of a storm "
    "in the afternoon. At noon the wind rose. The sky over the water turned the color of "
    "slate, and the first heavy drops of rain began to fall on the cobbles. Shopkeepers "
    "pulled their goods inside, the farmers covered their carts with canvas, and the square "
    "emptied within minutes. Down at the harbor, the boats that had gone out came back one "
    "by one, riding the swell past the lighthouse, and the harbor master ticked each name "
    "off his list. Only one boat was missing, a small blue trawler called the Morning Star. "
    "Her captain was a careful man who had fished these waters for thirty years, and no one "
    "believed he would take a risk with the weather. Still, as the afternoon darkened, a "
    "crowd gathered on the sea wall to watch the horizon. Just before four o'clock, someone "
    "shouted and pointed. A light was moving between the waves, rising and falling, and "
    "slowly growing brighter. The Morning Star came home at last, battered but whole, and "
    "the whole town cheered as she tied up at the quay."
)
COPY = f"Rewrite the following text exactly, changing only the word 'winter' to 'summer':\n\n{TEXT}"
FREE = "Write a long story about a lighthouse keeper who finds a map in a bottle."
# --equality's prompts: questions, code, lists and edits, where drafts are taken and refused.
EQUALITY = (
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List ten fruits, one a line.",
    "Explain what a hash table is to a child.",
    "Fix the typo in this sentence and repeat it: 'The quick brown fox jumsp over the lazy dog.'",
    "Translate to French: 'The weather is nice today and we are going to the beach.'",
    "Write a haiku about the sea.",
    "Rename the variable x to count in: def f(x):\n    y = x + 1\n    return x * y",
)


def run(engine: Engine, request: PreparedRequest) -> tuple[float, list[int], int, int]:
    """Decode tok/s (first token to last), the tokens, drafted and accepted."""
    generation = engine.generate(request)
    tokens: list[int] = []
    for delta in generation:
        tokens.extend(delta.token_ids)
    stats = generation.stats()
    return stats.decode_tokens_per_s, tokens, stats.drafted_tokens, stats.accepted_tokens


def paired(engine: Engine, name: str, prompt: str, args: argparse.Namespace) -> None:
    spec = Speculation("prompt_lookup", args.num_draft_tokens, args.ngram_size)
    messages = [{"role": "user", "content": prompt}]
    plain = engine.prepare(messages, SamplingParams(temperature=0, max_tokens=args.max_tokens))
    fast = engine.prepare(
        messages, SamplingParams(temperature=0, max_tokens=args.max_tokens, speculative=spec)
    )
    run(engine, plain)  # warm
    ratios = []
    for i in range(args.rounds):
        rate, base, _, _ = run(engine, plain)
        spec_rate, tokens, drafted, accepted = run(engine, fast)
        ratios.append(spec_rate / rate)
        print(
            f"{name} round {i + 1}: plain {rate:.1f} tok/s, prompt lookup {spec_rate:.1f} tok/s "
            f"= {spec_rate / rate:.2f}x; {len(tokens)} tokens, drafted {drafted}, accepted "
            f"{accepted}; greedy text identical: {tokens == base}",
            flush=True,
        )
    print(f"{name}: median {statistics.median(ratios):.2f}x over {args.rounds} rounds", flush=True)


def equality(engine: Engine, args: argparse.Namespace) -> None:
    """Greedy tokens with and without prompt lookup on ``EQUALITY``'s prompts and the two above;
    the first token where they part, for each prompt that differs."""
    spec = Speculation("prompt_lookup", args.num_draft_tokens, args.ngram_size)
    same = 0
    prompts = (*EQUALITY, FREE, COPY)
    for prompt in prompts:
        params = SamplingParams(temperature=0, max_tokens=args.free_tokens)
        messages = [{"role": "user", "content": prompt}]
        _, base, _, _ = run(engine, engine.prepare(messages, params))
        fast = SamplingParams(temperature=0, max_tokens=args.free_tokens, speculative=spec)
        _, tokens, drafted, accepted = run(engine, engine.prepare(messages, fast))
        if tokens == base:
            same += 1
        else:
            at = next(
                (i for i, (a, b) in enumerate(zip(tokens, base, strict=False)) if a != b), None
            )
            print(f"differs at token {at}: {prompt[:40]!r}", flush=True)
        print(f"  drafted {drafted}, accepted {accepted}: {prompt[:50]!r}", flush=True)
    print(f"greedy identical: {same} of {len(prompts)} prompts", flush=True)


def verify_cost(args: argparse.Namespace) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    from mlx_trio.api.bench.models import make_model

    model = make_model(args.quick, quantized=False, shape=args.shape)
    cache = make_prompt_cache(model)
    context = mx.random.randint(0, 1000, (1, args.context))
    for start in range(0, args.context, 512):
        model(context[:, start : start + 512], cache=cache)
        mx.eval([c.state for c in cache])

    def forward(n: int) -> float:
        tokens = mx.random.randint(0, 1000, (1, n))
        mx.eval(tokens)
        start = time.perf_counter()
        logits = model(tokens, cache=cache)
        mx.eval(mx.argmax(logits, axis=-1))
        elapsed = time.perf_counter() - start
        trim_prompt_cache(cache, n)
        return elapsed

    sizes = (1, *range(2, (args.num_draft_tokens or DEFAULT_NUM_DRAFT_TOKENS) + 2))
    shape = "quick" if args.quick else args.shape
    for _ in range(3):  # warm every shape
        for n in sizes:
            forward(n)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(args.rounds * 10):
        for n in sizes:
            times[n].append(forward(n))
    one = statistics.median(times[1])
    for n in sizes:
        cost = statistics.median(times[n])
        print(
            f"{shape} forward of {n} token(s) over {args.context}: {cost * 1e3:.2f} ms "
            f"= {cost / one:.2f}x one token's",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=480)
    parser.add_argument("--free-tokens", type=int, default=160)
    parser.add_argument("--num-draft-tokens", type=int, default=None)
    parser.add_argument("--ngram-size", type=int, default=None)
    parser.add_argument("--only", choices=["copy", "free", "equality"], default=None)
    parser.add_argument("--verify-cost", action="store_true")
    parser.add_argument("--shape", choices=["1b", "8b"], default="8b")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--quick", action="store_true", help="a tiny model: checks the script")
    args = parser.parse_args()
    if args.verify_cost:
        import mlx.core as mx

        if args.device == "cpu":
            mx.set_default_device(mx.cpu)
        verify_cost(args)
        return
    engine = Engine.load(args.model, device=args.device)
    print(f"model {engine.model_id} ({engine.loaded.dtype} on {engine.loaded.device})", flush=True)
    if args.only in (None, "copy"):
        paired(engine, "copy", COPY, args)
    if args.only in (None, "free"):
        args.max_tokens = args.free_tokens
        paired(engine, "free", FREE, args)
    if args.only == "equality":
        equality(engine, args)


if __name__ == "__main__":
    main()
