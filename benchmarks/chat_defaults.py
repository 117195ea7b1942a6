"""Which sampling defaults give the default model a good first chat answer?

    python benchmarks/chat_defaults.py              # the default model, --device cpu, 3 seeds

Each candidate answers `atlas bench coherence --set first-chat`'s ten first questions under
`--seeds` seeds, at `atlas chat`'s answer limit, and is judged as that bench judges: no
repeating 4-gram said 3+ times, an end of turn within the limit, the facts where a question
has one. Candidates run interleaved (seed by seed) so a change in machine load hits them
alike. Prints the pass count per candidate and the failures of the worst one.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from atlas_cli.backend.sample import SamplingOverrides
from atlas_cli.bench import coherence
from atlas_cli.session import open_model

CANDIDATES = {
    "recipe before (t 0.2, top-p 0.9)": SamplingOverrides(temperature=0.2, top_p=0.9),
    "t 0.2, top-p 0.9, repeat 1.1": SamplingOverrides(
        temperature=0.2, top_p=0.9, repeat_penalty=1.1
    ),
    "t 0.2, top-p 0.9, repeat 1.2": SamplingOverrides(
        temperature=0.2, top_p=0.9, repeat_penalty=1.2
    ),
    "t 0.7, top-p 0.9, repeat 1.1": SamplingOverrides(
        temperature=0.7, top_p=0.9, repeat_penalty=1.1
    ),
    "t 0.2, top-p 0.9, presence 0.5": SamplingOverrides(
        temperature=0.2, top_p=0.9, presence_penalty=0.5
    ),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=coherence.CHAT_MAX_TOKENS)
    args = ap.parse_args()
    model = open_model(args.model, device=args.device)
    verdicts: dict[str, list[coherence.Verdict]] = {name: [] for name in CANDIDATES}
    seconds = dict.fromkeys(CANDIDATES, 0.0)
    for seed in range(args.seeds):
        for name, given in CANDIDATES.items():
            t0 = time.perf_counter()
            seeded = replace(given, seed=seed)
            verdicts[name] += coherence.run(model, coherence.FIRST_CHAT, args.max_tokens, seeded)
            seconds[name] += time.perf_counter() - t0
    total = len(coherence.FIRST_CHAT) * args.seeds
    print(f"{args.model} on {args.device}: {total} answers per candidate")
    for name, vs in verdicts.items():
        passed = sum(v.passed for v in vs)
        tokens = sum(v.completion_tokens for v in vs)
        print(
            f"{passed:3d}/{total}  {name:34s} {tokens / total:6.0f} tokens/answer "
            f"({seconds[name]:.0f} s)"
        )
    worst = min(verdicts, key=lambda n: sum(v.passed for v in verdicts[n]))
    print(f"\nfailures of {worst!r}:")
    for v in verdicts[worst]:
        if not v.passed:
            print(f"  {v.prompt!r}: {', '.join(v.problems)}")


if __name__ == "__main__":
    main()
