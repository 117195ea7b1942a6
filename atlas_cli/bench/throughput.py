"""llama-bench-style throughput runs: pp (prompt processing), tg (generation), pp+tg, at a depth.

Each repetition starts from an empty cache; the depth tokens are prefilled untimed first, as
llama-bench's `-d` does. Prompt and generated tokens are random ids (seeded), so that no
tokenizer or sampler time is counted: tg feeds one token at a time through the cached decode.
"""

from __future__ import annotations

import csv
import io
import json
import random
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from atlas_cli.bench import progress, stats, sysinfo
from atlas_cli.errors import UsageError

OUTPUT_FORMATS = ("md", "json", "jsonl", "csv")


@dataclass(frozen=True)
class BenchSpec:
    n_prompt: int
    n_gen: int
    n_depth: int = 0
    n_threads: int | None = None  # None: leave the BLAS thread pool as it is

    @property
    def name(self) -> str:
        """llama-bench's test column: pp512, tg128, pp512+tg128, with ` @ d4096` for a depth."""
        if self.n_prompt and self.n_gen:
            base = f"pp{self.n_prompt}+tg{self.n_gen}"
        elif self.n_prompt:
            base = f"pp{self.n_prompt}"
        else:
            base = f"tg{self.n_gen}"
        return f"{base} @ d{self.n_depth}" if self.n_depth else base

    @property
    def tokens(self) -> int:
        """Tokens a repetition processes (the t/s numerator)."""
        return self.n_prompt + self.n_gen


def parse_int_list(text: str, flag: str) -> list[int]:
    """`512,1024` -> [512, 1024]; llama-bench's comma lists."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{flag} takes a comma-separated list of integers, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise UsageError(f"{flag} takes non-negative integers, got {text!r}")
    return values


def parse_pg(text: str) -> tuple[int, int]:
    """`-pg 512,128` -> (512, 128)."""
    values = parse_int_list(text, "-pg")
    if len(values) != 2 or not all(values):
        raise UsageError(f"-pg takes PROMPT,GEN (two positive integers), got {text!r}")
    return values[0], values[1]


def parse_threads(text: str | None) -> list[int | None]:
    """`-t 1,2,4` -> [1, 2, 4]; no -t: [None], the thread pools as they are."""
    if not text:
        return [None]
    threads = parse_int_list(text, "-t")
    if any(t < 1 for t in threads):
        raise UsageError("-t takes thread counts of at least 1")
    return threads


def specs_from_flags(
    n_prompt: str, n_gen: str, pg: Sequence[str], n_depth: str, threads: str | None
) -> list[BenchSpec]:
    """The tests that llama-bench's flags ask for; a bad value is a UsageError naming its flag."""
    thread_list = parse_threads(threads)
    return expand(
        parse_int_list(n_prompt, "-p"),
        parse_int_list(n_gen, "-n"),
        [parse_pg(v) for v in pg],
        parse_int_list(n_depth, "-d"),
        thread_list,
    )


def expand(
    n_prompt: Sequence[int],
    n_gen: Sequence[int],
    pg: Sequence[tuple[int, int]] = (),
    depths: Sequence[int] = (0,),
    threads: Sequence[int | None] = (None,),
) -> list[BenchSpec]:
    """Every combination, in llama-bench's order: per thread count and depth, the pp tests,
    then tg, then pp+tg. A 0 in -p or -n disables that kind (as in llama-bench)."""
    specs: list[BenchSpec] = []
    for t in threads:
        for d in depths:
            specs += [BenchSpec(p, 0, d, t) for p in n_prompt if p > 0]
            specs += [BenchSpec(0, n, d, t) for n in n_gen if n > 0]
            specs += [BenchSpec(p, n, d, t) for p, n in pg]
    if not specs:
        raise UsageError("nothing to run: every -p and -n value is 0 and no -pg was given")
    return list(dict.fromkeys(specs))  # drop duplicates, keep the order


def _random_ids(rng: random.Random, n: int, vocab: int, bos: int | None) -> list[int]:
    ids = [rng.randrange(vocab) for _ in range(n)]
    if ids and bos is not None:
        ids[0] = bos
    return ids


def time_once(engine, spec: BenchSpec, rng: random.Random, bos: int | None = None) -> float:
    """Seconds for one repetition of `spec` on `engine` (the depth prefill is not timed)."""
    vocab = engine.tokenizer.vocab_size
    engine.reset()
    depth_ids = _random_ids(rng, spec.n_depth, vocab, bos)
    if depth_ids:
        engine.prefill(depth_ids)
    prompt_ids = _random_ids(rng, spec.n_prompt, vocab, None if depth_ids else bos)
    t0 = time.perf_counter()
    if prompt_ids:
        engine.prefill(depth_ids + prompt_ids)  # reuses the depth prefix: only the prompt runs
    token = bos if bos is not None and not (depth_ids or prompt_ids) else rng.randrange(vocab)
    for _ in range(spec.n_gen):
        engine.step(token)
        token = rng.randrange(vocab)
    return time.perf_counter() - t0


@contextmanager
def _thread_limit(n: int | None):
    """Limit BLAS (the reference path) and numba's pool (the fast CPU path) to `n` threads.
    numba's setting is per calling thread, which is the one that runs the benchmark."""
    if n is None:
        yield
        return
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=n):
        numba = sys.modules.get("numba")
        if numba is None:
            yield
            return
        before = numba.get_num_threads()
        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
        try:
            yield
        finally:
            numba.set_num_threads(before)


def run(
    model,
    specs: Iterable[BenchSpec],
    repetitions: int = 5,
    warmup: bool = True,
    seed: int = 0,
    on_sample: Callable[[BenchSpec, int, float], None] | None = None,
    on_warmup: Callable[[BenchSpec, float], None] | None = None,
) -> list[dict[str, Any]]:
    """One record per spec with every sample (ns and t/s), llama-bench's fields and ours.
    `on_sample(spec, i, seconds)` follows each timed run, `on_warmup(spec, seconds)` each
    warm-up."""
    if repetitions < 1:
        raise UsageError(f"-r must be at least 1, got {repetitions}")
    engine = model.engine
    bos = engine.tokenizer.bos_id if engine.tokenizer.add_bos else None
    facts = sysinfo.model_facts(model)
    records = []
    for spec in specs:
        need = spec.n_depth + spec.tokens
        if need > engine.context_length:
            raise UsageError(
                f"{spec.name} needs {need:,} positions but the context holds "
                f"{engine.context_length:,}; lower -p/-n/-d or raise --ctx-size"
            )
        rng = random.Random(seed)
        with _thread_limit(spec.n_threads):
            env = sysinfo.environment(model.device)
            if warmup:  # llama-bench's warm-up: the prompt once and one generated token
                seconds = time_once(engine, warmup_spec(spec), rng, bos)
                if on_warmup:
                    on_warmup(spec, seconds)
            samples = []
            for i in range(repetitions):
                seconds = time_once(engine, spec, rng, bos)
                samples.append(seconds)
                if on_sample:
                    on_sample(spec, i, seconds)
        engine.reset()
        records.append(_record(spec, samples, env, facts))
    return records


def warmup_spec(spec: BenchSpec) -> BenchSpec:
    return BenchSpec(spec.n_prompt, min(spec.n_gen, 1))


def run_with_progress(
    model, specs: Sequence[BenchSpec], repetitions: int, warmup: bool
) -> list[dict[str, Any]]:
    """`run`, with one progress line per warm-up and per timed repetition on stderr (the
    warm-ups are not timed, but they take as long as a run: hiding them looked like a hang)."""
    steps = len(specs) * (repetitions + (1 if warmup else 0))
    with progress.steps("bench", steps) as report:
        return run(
            model,
            specs,
            repetitions=repetitions,
            warmup=warmup,
            on_sample=lambda spec, i, s: report(f"{spec.name} {spec.tokens / s:.2f} t/s"),
            on_warmup=lambda spec, s: report(
                f"{spec.name} warm-up ({warmup_spec(spec).name}, untimed) {s:.2f} s"
            ),
        )


def _record(spec: BenchSpec, samples: list[float], env: dict, facts: dict) -> dict[str, Any]:
    samples_ns = [round(s * 1e9) for s in samples]
    samples_ts = [spec.tokens / s for s in samples]
    avg_ns, std_ns = stats.mean_std(samples_ns)
    avg_ts, std_ts = stats.mean_std(samples_ts)
    return {
        **env,
        **facts,
        "test": spec.name,
        "n_prompt": spec.n_prompt,
        "n_gen": spec.n_gen,
        "n_depth": spec.n_depth,
        "repetitions": len(samples),
        "avg_ns": round(avg_ns),
        "stddev_ns": round(std_ns),
        "avg_ts": avg_ts,
        "stddev_ts": std_ts,
        "samples_ns": samples_ns,
        "samples_ts": samples_ts,
    }


# -- output ------------------------------------------------------------------------------------

TABLE_COLUMNS = ("model", "size", "params", "backend", "threads", "test", "t/s")


def _row(r: dict[str, Any]) -> list[str]:
    return [
        r["model"],
        sysinfo.format_size(r["model_size"]),
        sysinfo.format_params(r["model_n_params"]),
        r["backend"],
        str(r.get("n_threads") or ""),
        r["test"],
        f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f}",
    ]


def markdown_table(records: Sequence[dict[str, Any]]) -> str:
    """llama-bench's Markdown table: text left-aligned, numbers right-aligned."""
    rows = [_row(r) for r in records]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(TABLE_COLUMNS)]
    right = {"size", "params", "threads", "test", "t/s"}

    def fmt(cells: Sequence[str]) -> str:
        parts = [
            c.rjust(w) if name in right else c.ljust(w)
            for c, w, name in zip(cells, widths, TABLE_COLUMNS, strict=True)
        ]
        return "| " + " | ".join(parts) + " |"

    rule = [
        "-" * (w - 1) + ":" if name in right else "-" * w
        for w, name in zip(widths, TABLE_COLUMNS, strict=True)
    ]
    return "\n".join([fmt(TABLE_COLUMNS), "| " + " | ".join(rule) + " |", *map(fmt, rows)])


def render(records: Sequence[dict[str, Any]], fmt: str) -> str:
    if fmt == "md":
        return markdown_table(records)
    if fmt == "json":
        return json.dumps(list(records), indent=2)
    if fmt == "jsonl":
        return "\n".join(json.dumps(r) for r in records)
    if fmt == "csv":
        buf = io.StringIO()
        fields = list(dict.fromkeys(k for r in records for k in r))
        writer = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        for r in records:
            # lists (the samples) as JSON text in one cell, as llama-bench's CSV quotes them
            writer.writerow({k: json.dumps(v) if isinstance(v, list) else v for k, v in r.items()})
        return buf.getvalue().rstrip("\n")
    raise UsageError(f"unknown output format {fmt!r} (choose from {', '.join(OUTPUT_FORMATS)})")


def as_result(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The document `--save-baseline` writes and `--baseline` reads."""
    return {"kind": "throughput", "records": list(records)}
