"""The coherence gate: fixed prompts at temperature 0; fail on degenerate output (empty,
repeating n-grams, no end of turn within the token limit) or on answers that miss a fact.

It catches a broken kernel or loader that still produces fast tokens: numbers alone would pass.
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


def run(model, probes=PROBES, max_tokens: int = MAX_TOKENS) -> list[Verdict]:
    from atlas_cli.backend.engine import GenerationStats
    from atlas_cli.backend.sample import SamplingOverrides

    verdicts = []
    for probe in probes:
        stats = GenerationStats()
        ids = model.chat_prompt([{"role": "user", "content": probe.prompt}])
        for _ in model.generate(
            ids,
            max_tokens=max_tokens,
            stats=stats,
            sampling=SamplingOverrides(temperature=0, seed=42),
        ):
            pass
        verdicts.append(judge(probe, stats.text, stats.finish_reason, stats.completion_tokens))
    return verdicts


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
