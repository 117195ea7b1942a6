"""A few turns of MLPerf Edge Agentic through MLCommons' own harness against `atlas serve`.

    # the harness needs Python 3.12+: a venv of its own, from a checkout of mlcommons/endpoints
    python3.12 -m venv ../venv-mlperf && ../venv-mlperf/bin/pip install ./endpoints
    atlas serve smollm2 --port 18790 &
    python benchmarks/mlperf_harness.py --harness ../venv-mlperf/bin/inference-endpoint \\
        --trajectories agentic_coding_2.5h.jsonl --rows 6

Writes into --out: the first --rows messages of the first conversation (each user or tool row
is one request), the served model's tokenizer as a Hugging Face directory (the harness counts
tokens with it; the embedded model is a GGUF), and a config of the Edge Agentic example's
performance phase cut down to that subset; then runs `inference-endpoint benchmark
from-config` and prints, per request, the harness's TTFT and latency and whether the answer
was a tool call (a call streamed as it is written has a TTFT of prefill + a few tokens).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CONFIG = """name: "edge-agentic-few-turns"
version: "1.0"
type: "online"
timeout: 3000
model_params:
  name: "{model}"
  tokenizer_name: "{tokenizer}"
  temperature: 0
  seed: 42
  max_new_tokens: {max_tokens}
datasets:
  - name: agentic_coding
    type: performance
    path: {subset}
    agentic_inference:
      turn_timeout_s: 600.0
      num_trajectories_to_issue: 1
settings:
  runtime:
    min_duration_ms: 0
    max_duration_ms: 2400000
  load_pattern:
    type: agentic_inference
    target_concurrency: 1
  client:
    num_workers: 1
    max_connections: 1
    warmup_connections: 0
endpoint_config:
  endpoints:
    - "{url}"
  api_type: openai
  api_key: null
report_dir: {report}
"""


def served_model(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as resp:
        return json.load(resp)["data"][0]["id"]


def export_tokenizer(model: str, out: Path) -> Path:
    """The model's tokenizer and chat template as a directory `transformers` loads."""
    from atlas_cli.session import open_model

    tok = open_model(model).tokenizer
    out.mkdir(parents=True, exist_ok=True)
    tok.backend.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "chat_template": tok.chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def per_request(report: Path) -> list[tuple]:
    events = [json.loads(line) for line in (report / "events.jsonl").open()]
    by: dict[str, dict] = {}
    for e in events:
        if e["sample_uuid"]:
            by.setdefault(e["sample_uuid"], {})[e["event_type"]] = e
    rows = []
    for d in by.values():
        sent, first, done = d["sample.issued"], d["sample.recv_first"], d["sample.complete"]
        calls = (
            done["data"][3] if isinstance(done["data"], list) and len(done["data"]) > 3 else None
        )
        rows.append(
            (
                sent["turn"],
                (first["timestamp_ns"] - sent["timestamp_ns"]) / 1e6,
                (done["timestamp_ns"] - sent["timestamp_ns"]) / 1e6,
                bool(calls),
            )
        )
    return sorted(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--harness", required=True, help="the inference-endpoint executable")
    p.add_argument("--trajectories", required=True, type=Path)
    p.add_argument("--url", default="http://127.0.0.1:18790")
    p.add_argument("--model", default="smollm2", help="what atlas serves (for its tokenizer)")
    p.add_argument("--rows", type=int, default=6, help="messages of the first conversation")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=Path("mlperf-harness"))
    opts = p.parse_args(argv)
    out = opts.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for line in opts.trajectories.open()]
    first = [r for r in rows if r["conversation_id"] == rows[0]["conversation_id"]][: opts.rows]
    subset = out / "subset.jsonl"
    subset.write_text("".join(json.dumps(r) + "\n" for r in first))
    config = out / "config.yaml"
    config.write_text(
        CONFIG.format(
            model=served_model(opts.url),
            tokenizer=export_tokenizer(opts.model, out / "tokenizer"),
            max_tokens=opts.max_tokens,
            subset=subset,
            url=opts.url,
            report=out / "report",
        )
    )
    cmd = [opts.harness, "benchmark", "from-config", "--config", str(config)]
    subprocess.run(cmd, check=True, cwd=out)
    print((out / "report" / "report.txt").read_text().split("TTFT:")[0])
    print("| turn | TTFT ms | latency ms | tool call |\n| ---: | ---: | ---: | --- |")
    for turn, ttft, latency, call in per_request(out / "report"):
        print(f"| {turn} | {ttft:,.0f} | {latency:,.0f} | {'yes' if call else 'no'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
