"""The coherence gate: fixed prompts; fail on degenerate output (empty, repeating n-grams, no
end of turn within the token limit) or on answers that miss a fact.

Two sets. `facts` runs at temperature 0: it catches a broken kernel or loader that still
produces fast tokens (numbers alone would pass). `first-chat` asks what people ask a model
first, sampled the way `atlas chat` samples (the recipe's defaults) over several seeds: it is
how the default model's chat defaults were chosen (docs/performance.md).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

MAX_TOKENS = 64
NGRAM = 4  # a 4-word sequence said 3 times in a short answer is a loop
NGRAM_REPEATS = 3


@dataclass(frozen=True)
class Probe:
    prompt: str
    expect: tuple[str, ...]  # each must appear (case-insensitive, as a whole word)


# Questions the 135M default model answers right at temperature 0: a failure means the
# engine broke, not that the model is small.
PROBES = (
    Probe("What is the capital of France?", ("Paris",)),
    Probe("What is 2 + 2?", ("4",)),
    Probe("How many days are in a week?", ("7",)),
    Probe("What is the boiling point of water in degrees Celsius?", ("100",)),
    Probe("What is the chemical symbol for gold?", ("Au",)),
)


# What a new user types first; the facts are the ones the answer cannot do without.
FIRST_CHAT = (
    Probe("Hi!", ()),
    Probe("What can you do?", ()),
    Probe("What is the capital of France?", ("Paris",)),
    Probe("Write a haiku about the sea.", ()),
    Probe("Explain what a computer is in one sentence.", ()),
    Probe("Give me three tips for better sleep.", ()),
    Probe("What is 12 times 12?", ("144",)),
    Probe("Who wrote Romeo and Juliet?", ("Shakespeare",)),
    Probe("How do I reverse a list in Python?", ()),
    Probe("Tell me a joke.", ()),
)
SETS = {"facts": PROBES, "first-chat": FIRST_CHAT}
CHAT_MAX_TOKENS = 512  # `atlas chat`'s default answer limit


@dataclass(frozen=True)
class Verdict:
    prompt: str
    text: str
    finish_reason: str
    completion_tokens: int
    problems: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return not self.problems


def repeated_ngram(text: str, n: int = NGRAM, times: int = NGRAM_REPEATS) -> str | None:
    """The first word n-gram that occurs `times` or more, or None."""
    words = re.findall(r"\w+", text.lower())
    counts = Counter(tuple(words[i : i + n]) for i in range(len(words) - n + 1))
    for gram, count in counts.items():
        if count >= times:
            return " ".join(gram)
    return None


def judge(probe: Probe, text: str, finish_reason: str, completion_tokens: int) -> Verdict:
    problems = []
    if not text.strip():
        problems.append("empty answer")
    loop = repeated_ngram(text)
    if loop:
        problems.append(f"repeats {loop!r} {NGRAM_REPEATS}+ times")
    if finish_reason != "stop":
        problems.append(f"no end of turn within {completion_tokens} tokens")
    for fact in probe.expect:
        if not re.search(rf"(?<!\w){re.escape(fact)}(?!\w)", text, re.IGNORECASE):
            problems.append(f"missing {fact!r}")
    return Verdict(probe.prompt, text, finish_reason, completion_tokens, tuple(problems))


def run(model, probes=PROBES, max_tokens: int = MAX_TOKENS, sampling=None) -> list[Verdict]:
    """Each probe answered once: at temperature 0 (seed 42), or with `sampling`, a
    SamplingOverrides over the model's recipe defaults (its seed fixed by the caller)."""
    from atlas_cli.backend.engine import GenerationStats
    from atlas_cli.backend.sample import SamplingOverrides

    sampling = sampling or SamplingOverrides(temperature=0, seed=42)
    verdicts = []
    for probe in probes:
        stats = GenerationStats()
        ids = model.chat_prompt([{"role": "user", "content": probe.prompt}])
        for _ in model.generate(ids, max_tokens=max_tokens, stats=stats, sampling=sampling):
            pass
        verdicts.append(judge(probe, stats.text, stats.finish_reason, stats.completion_tokens))
    return verdicts


def run_sampled(model, probes, seeds: int, max_tokens: int, given=None) -> list[Verdict]:
    """Every probe under `seeds` seeds (0, 1, ...), sampled with `given` (a SamplingOverrides,
    unset fields from the recipe) as a chat would sample."""
    from dataclasses import replace

    from atlas_cli.backend.sample import SamplingOverrides

    given = given or SamplingOverrides()
    return [
        v
        for seed in range(seeds)
        for v in run(model, probes, max_tokens, replace(given, seed=seed))
    ]


def report(verdicts: list[Verdict]) -> str:
    lines = []
    for v in verdicts:
        mark = "PASS" if v.passed else "FAIL"
        answer = " ".join(v.text.split())
        answer = answer if len(answer) <= 100 else answer[:97] + "..."
        lines.append(f"{mark}  {v.prompt}\n      -> {answer!r}")
        lines.extend(f"      ! {p}" for p in v.problems)
    failed = sum(not v.passed for v in verdicts)
    total = len(verdicts)
    lines.append(
        f"coherence: {'PASS' if not failed else 'FAIL'} ({total - failed}/{total} prompts passed)"
    )
    return "\n".join(lines)
