"""Tokenizers (HF `tokenizers`) built from GGUF metadata or tokenizer.json, and chat templates.

GGUF files carry no tokenizer.json: we rebuild one from `tokenizer.ggml.*` the way transformers
does (integrations/gguf/gguf_tokenizer_mapping.py), so our ids equal transformers' for the file.
Chat templates are rendered by `chat_template` (a sandbox with a budget).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from atlas_cli.backend.chat_template import render_template
from atlas_cli.errors import AtlasError, CorruptModelError, TemplateError, UnsupportedModelError

# Pre-tokenizer split patterns by `tokenizer.ggml.pre` (transformers' GGUF_PRE_TOKENIZER_SPLITS).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "qwen35": _QWEN35_SPLIT,
}

# Token text that ends an assistant turn in the chat formats we know, beyond the declared EOS.
END_OF_TURN_TEXTS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


@dataclass
class TextTokenizer:
    """Encode/decode plus what generation needs to know about special tokens."""

    backend: Tokenizer
    bos_id: int | None = None
    eos_id: int | None = None
    add_bos: bool = False
    chat_template: str | None = None
    stop_ids: set[int] = field(default_factory=set)
    template_name: str = "chat template"  # where the template came from, for its errors

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_id is None else self.backend.id_to_token(self.bos_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_id is None else self.backend.id_to_token(self.eos_id)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def longest_piece(self) -> int:
        """Characters of the longest vocabulary entry. A token never stands for more text than
        its entry spells (byte-level entries spell one character per byte), so a text needs at
        least len(text) / longest_piece tokens (characters the vocabulary cannot represent
        are dropped, and only those can make it need fewer): a bound known before encoding."""
        return max(
            (len(piece) for piece in self.backend.get_vocab(with_added_tokens=True)), default=1
        )

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on len(self.encode(text)) for text the vocabulary can represent,
        without encoding it."""
        return -(-len(text) // max(self.longest_piece, 1))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Ids for `text`; special-token text (e.g. `<|im_start|>`) maps to its id. With
        `add_special_tokens`, BOS is prepended when the model asks for it and it is not there."""
        # encode_batch lets go of the GIL while it works (encode does not): a server's event
        # loop keeps running while a long prompt is tokenised on a worker thread
        try:
            ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        except Exception as exc:  # a damaged tokenizer.json that parsed (`tokenizers`' errors)
            raise CorruptModelError(f"the tokenizer cannot encode text ({exc})") from None
        wants_bos = add_special_tokens and self.add_bos and self.bos_id is not None
        if wants_bos and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        try:
            return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        except Exception as exc:  # as in encode
            raise CorruptModelError(f"the tokenizer cannot decode ids ({exc})") from None

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **kwargs: Any,
    ) -> str:
        if not self.chat_template:
            raise TemplateError(
                "this model has no chat template; use --raw to send the prompt as plain text"
            )
        return render_template(
            self.chat_template,
            template_name=self.template_name,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )


def _stop_ids(backend: Tokenizer, eos_ids: list[int | None]) -> set[int]:
    ids = {i for i in eos_ids if i is not None}
    for text in END_OF_TURN_TEXTS:
        token_id = backend.token_to_id(text)
        if token_id is not None:
            ids.add(token_id)
    return ids


# ---------------------------------------------------------------------------------------------
# From GGUF metadata


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def _typed_list(md: dict[str, Any], key: str, types: tuple, source: str) -> list:
    value = md.get(key) or []
    if not isinstance(value, list) or not all(type(v) in types for v in value):
        names = "/".join(t.__name__ for t in types)
        raise CorruptModelError(f"{source}: {key} must be a list of {names} values")
    return value


def _token_id(md: dict[str, Any], key: str, source: str) -> int | None:
    value = md.get(key)
    if value is not None and type(value) is not int:
        raise CorruptModelError(f"{source}: {key} is {value!r} (expected a token id)")
    return value


def from_gguf_metadata(md: dict[str, Any], source: str = "GGUF") -> TextTokenizer:
    """`source` names the file in errors (its chat template's, for one)."""
    kind = md.get("tokenizer.ggml.model")
    tokens: list[str] = _typed_list(md, "tokenizer.ggml.tokens", (str,), source)
    if not tokens:
        raise UnsupportedModelError("the GGUF file has no tokenizer vocabulary")
    token_types = _typed_list(md, "tokenizer.ggml.token_type", (int,), source)
    template = md.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise CorruptModelError(f"{source}: tokenizer.chat_template is not a string")
    try:
        backend, add_bos_default = _gguf_backend(md, kind, tokens, token_types, source)
    except (AtlasError, RecursionError, MemoryError):
        raise
    except Exception as exc:  # `tokenizers` raises plain Exceptions from Rust
        raise CorruptModelError(f"{source}: cannot build the tokenizer ({exc})") from None
    bos = _token_id(md, "tokenizer.ggml.bos_token_id", source)
    eos = _token_id(md, "tokenizer.ggml.eos_token_id", source)
    eot = _token_id(md, "tokenizer.ggml.eot_token_id", source)
    return TextTokenizer(
        backend=backend,
        bos_id=bos,
        eos_id=eos,
        add_bos=bool(md.get("tokenizer.ggml.add_bos_token", add_bos_default)),
        chat_template=template,
        stop_ids=_stop_ids(backend, [eos, eot]),
        template_name=f"chat template ({source} tokenizer.chat_template)",
    )


def _gguf_backend(md, kind, tokens, token_types, source: str) -> tuple[Tokenizer, bool]:
    """The `tokenizers` model for a GGUF vocabulary, and whether it adds BOS by default."""
    if len(set(tokens)) != len(tokens):
        raise CorruptModelError(f"{source}: tokenizer.ggml.tokens lists a token twice")
    if kind == "gpt2":
        merges = _typed_list(md, "tokenizer.ggml.merges", (str,), source)
        if not all(" " in m for m in merges):
            raise CorruptModelError(
                f'{source}: tokenizer.ggml.merges must be pairs written "left right"'
            )
        backend = _byte_level_bpe(tokens, merges)
        pre = md.get("tokenizer.ggml.pre")
        split = PRE_TOKENIZER_SPLITS.get(pre) if isinstance(pre, str) else None
        if split is not None:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        add_bos_default = False
    elif kind == "llama":
        scores = _typed_list(md, "tokenizer.ggml.scores", (int, float), source)
        backend = _sentencepiece_bpe(tokens, scores)
        add_bos_default = True  # llama.cpp's default for SentencePiece vocabularies
    else:
        raise UnsupportedModelError(
            f"tokenizer type {kind!r} is not supported (supported: gpt2, llama)"
        )
    _add_marked_tokens(backend, tokens, token_types, byte_level=kind == "gpt2")
    return backend, add_bos_default


def _byte_level_bpe(tokens: list[str], merges: list[str]) -> Tokenizer:
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # llama.cpp stores some tokens as plain text; byte-level BPE wants them in the byte alphabet.
    vocab = {
        (t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode())): i
        for i, t in enumerate(tokens)
    }
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(tokens: list[str], scores: list[float]) -> Tokenizer:
    """A SentencePiece BPE vocabulary (Llama 2 style) as an HF BPE with byte fallback; merges
    come from the scores, as transformers' `generate_merges` derives them."""
    vocab = {t: i for i, t in enumerate(tokens)}
    score = dict(zip(tokens, scores or [0.0] * len(tokens), strict=False))
    merges = []
    for piece, piece_score in score.items():
        local = [
            (piece[:k], piece[k:], piece_score)
            for k in range(1, len(piece))
            if piece[:k] in vocab and piece[k:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    unk = "<unk>" if "<unk>" in vocab else None
    backend = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(a, b) for a, b, _ in merges],
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1, right=0),
        ]
    )
    return backend


def _add_marked_tokens(backend: Tokenizer, tokens, token_types, byte_level: bool) -> None:
    """Control tokens become special tokens, user-defined ones plain added tokens, so that
    both are matched whole in text (as llama.cpp and transformers do)."""
    alphabet = set(_bytes_to_unicode().values()) if byte_level else None
    control, user = [], []
    for token, kind in zip(tokens, token_types, strict=False):
        if kind == TOKEN_TYPE_CONTROL and (alphabet is None or set(token) <= alphabet):
            control.append(AddedToken(token, normalized=False, special=True))
        elif kind == TOKEN_TYPE_USER_DEFINED:
            user.append(AddedToken(token, normalized=False, special=False))
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)


# ---------------------------------------------------------------------------------------------
# From a Hugging Face model directory


def from_hf_directory(path: Path, config: dict[str, Any]) -> TextTokenizer:
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        raise UnsupportedModelError(f"{path}: no tokenizer.json")
    try:
        backend = Tokenizer.from_file(str(tok_file))
    except Exception as exc:  # `tokenizers` raises plain Exceptions from Rust
        raise CorruptModelError(f"{tok_file}: cannot parse the tokenizer ({exc})") from None
    tok_config = _read_json(path / "tokenizer_config.json")
    template, origin = _hf_template(path, tok_config)

    def token_id(entry) -> int | None:
        if isinstance(entry, dict):
            entry = entry.get("content")
        return backend.token_to_id(entry) if isinstance(entry, str) else None

    bos = token_id(tok_config.get("bos_token"))
    eos = token_id(tok_config.get("eos_token"))
    if bos is None and _is_id(config.get("bos_token_id")):
        bos = config["bos_token_id"]
    generation = _read_json(path / "generation_config.json").get("eos_token_id")
    eos_list = [i for i in (*_ids(config.get("eos_token_id")), *_ids(generation)) if _is_id(i)]
    return TextTokenizer(
        backend=backend,
        bos_id=bos,
        eos_id=eos if eos is not None else next(iter(eos_list), None),
        add_bos=bool(tok_config.get("add_bos_token", False)),
        chat_template=template,
        stop_ids=_stop_ids(backend, [eos, *eos_list]),
        template_name=f"chat template ({path.name}/{origin})",
    )


def _is_id(value: Any) -> bool:
    return type(value) is int and value >= 0


def _ids(value: Any) -> list:
    return value if isinstance(value, list) else [value]


def _hf_template(path: Path, tok_config: dict[str, Any]) -> tuple[str | None, str]:
    """The chat template and the file it came from (chat_template.jinja wins)."""
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # a list of named templates: take the default one
        named = [t for t in template if isinstance(t, dict)]
        template = next((t.get("template") for t in named if t.get("name") == "default"), None)
    origin = "tokenizer_config.json"
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        template, origin = jinja.read_text(errors="replace"), jinja.name
    elif (path / "chat_template.json").is_file():
        template = _read_json(path / "chat_template.json").get("chat_template", template)
        origin = "chat_template.json"
    if template is not None and not isinstance(template, str):
        raise CorruptModelError(f"{path / origin}: chat_template is not a string")
    return template, origin


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (ValueError, RecursionError) as exc:
        raise UnsupportedModelError(f"{path}: invalid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise CorruptModelError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value
