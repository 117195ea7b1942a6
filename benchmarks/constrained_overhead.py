"""What a JSON-schema constraint costs per generated token, on the default model.

    python benchmarks/constrained_overhead.py            # --device cpu, 3 rounds, 96 tokens

Each round generates greedily from the same chat prompt twice: once free, once held to a
JSON schema (an array of city records, so the answer runs long). It reports decode
milliseconds per token for both, and, for the constrained run, the time spent inside the
grammar itself (checking the drawn token, masks for rejected draws, committing the token) as
a share of its decode time: that share is the overhead, and unlike the end-to-end difference
it does not move with the load other processes put on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

from atlas_cli.backend.constraint import Constraint, grammar_tokenizer, json_schema_grammar
from atlas_cli.backend.engine import GenerationStats
from atlas_cli.backend.sample import SamplingParams
from atlas_cli.session import open_model
from atlas_cli.store import embedded, locate

SCHEMA = {
    "type": "object",
    "properties": {
        "cities": {
            "type": "array",
            "minItems": 6,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "country": {"type": "string"},
                    "population": {"type": "integer"},
                },
                "required": ["name", "country", "population"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["cities"],
    "additionalProperties": False,
}
QUESTION = "List six large cities with their country and population as JSON."


class Timed(Constraint):
    """A constraint that adds up the time spent in its own calls."""

    spent = 0.0

    def _timed(name):  # noqa: N805 - builds methods at class creation
        def call(self, *args):
            t0 = time.perf_counter()
            try:
                return getattr(Constraint, name)(self, *args)
            finally:
                self.spent += time.perf_counter() - t0

        return call

    allows = _timed("allows")
    masked = _timed("masked")
    accept = _timed("accept")
    valid_prefix = _timed("valid_prefix")


def run(model, ids, tokens, constraint=None) -> GenerationStats:
    stats = GenerationStats()
    params = SamplingParams(temperature=0)
    events = model.engine.generate(
        ids, max_tokens=tokens, sampling=params, stats=stats, constraint=constraint
    )
    for _ in events:
        pass
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model = open_model(str(locate.resolve(embedded.DEFAULT_MODEL)), device=args.device)
    tok = model.tokenizer
    ids = model.chat_prompt([{"role": "user", "content": QUESTION}])
    gtok = grammar_tokenizer(tok)
    grammar = "start: %json " + json_schema_grammar(SCHEMA)
    run(model, ids, 4)  # warm: kernels compiled, prompt cached
    free, held, shares, masks = [], [], [], []
    for _ in range(args.rounds):
        s = run(model, ids, args.tokens)
        free.append(s.eval_s / (s.completion_tokens - 1) * 1e3)
        c = Timed(gtok, grammar)
        s = run(model, ids, args.tokens, c)
        held.append(s.eval_s / (s.completion_tokens - 1) * 1e3)
        shares.append(c.spent / s.eval_s * 100)
        masks.append(f"{c.masks}/{s.completion_tokens}")
    med = statistics.median
    print(f"device {args.device}, {args.tokens} tokens, {args.rounds} rounds (median)")
    print(f"decode ms/token: free {med(free):.2f}  JSON schema {med(held):.2f}")
    print(f"time in the grammar: {med(shares):.2f}% of decode  (masks/tokens: {masks})")


if __name__ == "__main__":
    main()
