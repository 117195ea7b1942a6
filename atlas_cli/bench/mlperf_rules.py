"""The MLPerf Inference v6.1 run rules `atlas bench agentic` follows, and whether a run met them.

v6.1 (loadgen's mlperf.conf, as the Edge Agentic harness records them in its config.yaml):
the model seed 42 goes into every request; the dataloader seed orders the samples; the
scheduler seed draws arrival times, which a single-stream run (one request at a time) does not
have, so it is only recorded; a valid run lasts at least 600,000 ms, repeating the dataset
when it finishes sooner. `legacy` is the seed 42 everywhere that earlier replays used.

The replay orders whole conversations by the dataloader seed (a numpy PCG64 permutation) and
keeps each conversation's turns in order: a turn's prompt is the history before it.
"""

from __future__ import annotations

from dataclasses import dataclass

ROUND = "v6.1"
MIN_DURATION_S = 600.0  # 600,000 ms


@dataclass(frozen=True)
class SeedSet:
    model: int  # the `seed` of every request
    dataloader: int  # the order of the conversations
    scheduler: int  # arrival times: none in single-stream, recorded only


SEED_SETS = {
    ROUND: SeedSet(model=42, dataloader=2747215439041700203, scheduler=16159082839903944936),
    "legacy": SeedSet(model=42, dataloader=42, scheduler=42),
}


def conversation_order(n: int, seeds: SeedSet) -> list[int]:
    """The order in which the n conversations are replayed."""
    import numpy as np  # not at import: the CLI's options read ROUND from here

    return [int(i) for i in np.random.default_rng(seeds.dataloader).permutation(n)]


def default_min_duration(limited: bool) -> float:
    """A whole-dataset run lasts the minimum; a run limited to a few turns is a quick look,
    which repeating for ten minutes would defeat."""
    return 0.0 if limited else MIN_DURATION_S


def validity(seed_set: str, limited: bool, capped: bool, wall_s: float) -> list[str]:
    """Why a run is not a valid v6.1 run; empty when it is."""
    reasons = []
    if seed_set != ROUND:
        reasons.append(f"seeds {seed_set!r}, not the {ROUND} set")
    if limited:
        reasons.append("limited to part of the dataset")
    if capped:
        reasons.append("prompts capped to fit the context")
    if wall_s < MIN_DURATION_S:
        reasons.append(f"ran {wall_s:.0f} s, under the {MIN_DURATION_S:.0f} s minimum")
    return reasons
