"""Grammar-constrained decoding: a Lark grammar (llguidance's dialect, with `%json` schemas)
and the model's tokenizer -> a per-request `Constraint` the sampler consults at every step.

llguidance (guidance-ai/llguidance, also behind vLLM's, SGLang's and llama.cpp's structured
output) computes the set of tokens the grammar allows next as a bitmask over the vocabulary.
Computing that mask costs ~0.3 ms a token on the default model's 49k vocabulary; checking
one token costs ~2 us. So the sampler draws first and asks `allows(token)`: when the grammar
takes the token (most steps) there is no mask at all; only a rejected draw pays for the mask
and draws again from the masked logits (llama.cpp's grammar sampler does the same). Greedy
output is exactly the masked argmax; with sampling, a first draw the grammar takes stands,
so the draws are llama.cpp's rather than those of sampling from masked logits alone.

The grammar only constrains what it describes: callers put free regions (reasoning, prose
before a tool call) into it as unconstrained text, so one matcher covers a whole answer.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

import numpy as np

from atlas_cli.backend.tokenizer import TextTokenizer
from atlas_cli.errors import GrammarError

log = logging.getLogger(__name__)

_TOKENIZERS: dict[int, tuple[TextTokenizer, GrammarTokenizer | None]] = {}
_MAX_TOKENIZERS = 4  # models a process keeps loaded at once (tests load a few)


class GrammarTokenizer:
    """llguidance's view of one tokenizer (building it walks the vocabulary: ~0.3 s, cached)."""

    def __init__(self, tokenizer: TextTokenizer):
        import llguidance

        self.vocab_size = tokenizer.vocab_size
        self.stop_ids = sorted(tokenizer.stop_ids) or None
        try:  # the tokenizer.json itself: llguidance reads the HF format natively
            self.ll = llguidance.LLTokenizer(
                tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=self.stop_ids
            )
        except ValueError:  # a decoder llguidance does not know: give it the token bytes
            wrapper = _BytesTokenizer(tokenizer, self.stop_ids)
            self.ll = llguidance.LLTokenizer(
                llguidance.TokenizerWrapper(wrapper), n_vocab=self.vocab_size
            )

    def is_special(self, text: str) -> bool:
        """Whether `text` is one special token: a grammar names it as `<text>`, since a
        special token never matches the same characters spelled out."""
        ids = self.ll.tokenize_str(text)
        return len(ids) == 1 and self.ll.is_special_token(ids[0])


class _BytesTokenizer:
    """The interface llguidance.TokenizerWrapper reads: each token's bytes and an encoder."""

    def __init__(self, tokenizer: TextTokenizer, stop_ids: list[int] | None):
        backend = tokenizer.backend
        self.eos_token_id = stop_ids[0] if stop_ids else 0
        self.bos_token_id = tokenizer.bos_id
        special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        self.special_token_ids = sorted(special)
        self.tokens = [(backend.id_to_token(i) or "").encode() for i in range(tokenizer.vocab_size)]
        self._encode = tokenizer.encode

    def __call__(self, text: str) -> list[int]:
        return self._encode(text)


def grammar_tokenizer(tokenizer: TextTokenizer) -> GrammarTokenizer | None:
    """The cached llguidance tokenizer, or None where llguidance cannot read this vocabulary
    (then requests run unconstrained, as before, and the log says so once)."""
    key = id(tokenizer)
    hit = _TOKENIZERS.get(key)
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    try:
        built: GrammarTokenizer | None = GrammarTokenizer(tokenizer)
    except Exception as exc:  # a vocabulary llguidance rejects: degrade, never fail requests
        log.warning("constrained decoding is off for this tokenizer: %s", exc)
        built = None
    if len(_TOKENIZERS) >= _MAX_TOKENIZERS:
        _TOKENIZERS.pop(next(iter(_TOKENIZERS)))
    _TOKENIZERS[key] = (tokenizer, built)
    return built


def json_schema_grammar(schema: dict, *, lenient: bool = False) -> str:
    """The `%json` body of a schema, written the way models and json.dumps write JSON
    (`", "` and `": "`, no other whitespace: flexible whitespace lets a small model loop on
    newlines forever)."""
    options = {
        "whitespace_flexible": False,
        "item_separator": ", ",
        "key_separator": ": ",
        "lenient": lenient,
    }
    return json.dumps({**schema, "x-guidance": options})


class Constraint:
    """One answer's grammar state: what the grammar allows next, and the tokens taken."""

    def __init__(self, gtok: GrammarTokenizer, lark: str, prefix: str = ""):
        """`prefix`: answer text already in the prompt (JSON mode's `{`), consumed first."""
        import llguidance

        self.gtok = gtok
        self.matcher = llguidance.LLMatcher(gtok.ll, llguidance.LLMatcher.grammar_from_lark(lark))
        if self.matcher.is_error():
            raise GrammarError(f"bad grammar: {_first_line(self.matcher.get_error())}")
        if prefix and not self.matcher.consume_tokens(gtok.ll.tokenize_str(prefix)):
            raise GrammarError(f"the answer's start {prefix!r} does not fit the grammar")
        self._bits = np.zeros((gtok.vocab_size + 31) // 32, dtype=np.int32)
        self.masks = 0  # masks computed (the draws the grammar rejected)

    def allows(self, token: int) -> bool:
        return self.matcher.validate_tokens([token]) == 1

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` the grammar takes in a row from here (drafts to verify)."""
        return self.matcher.validate_tokens(list(tokens)) if tokens else 0

    def mask(self) -> np.ndarray:
        """(V,) bool: the tokens the grammar allows next. A grammar that allows nothing
        (never expected) allows the stop tokens, so generation ends instead of failing."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        self.masks += 1
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")
        allowed = bits[: self.gtok.vocab_size].astype(bool)
        if not allowed.any():
            allowed[self.gtok.stop_ids or []] = True
        return allowed

    def masked(self, logits: np.ndarray) -> np.ndarray:
        allowed = self.mask()
        out = np.full(logits.shape, -np.inf, dtype=logits.dtype)
        n = min(len(allowed), logits.shape[0])
        out[:n] = np.where(allowed[:n], logits[:n], -np.inf)
        return out

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            # only a draw that skipped `allows` gets here: a caller bug, not a user error
            raise RuntimeError(f"token {token} does not fit the grammar: {self.error}")

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing but a stop token."""
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


def new_constraint(tokenizer: TextTokenizer, lark: str, prefix: str = "") -> Constraint | None:
    """A fresh constraint for one answer; None where the tokenizer cannot be constrained."""
    gtok = grammar_tokenizer(tokenizer)
    return None if gtok is None else Constraint(gtok, lark, prefix)


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "unknown error"
