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

A grammar comes from a client, so its cost is bounded. llguidance bounds each step itself
(`LLParserLimits`), but a regex such as `a{100000}` stays under those limits at ~30 ms a token,
and `a{1000000}` fails only once generation reaches it. So: the first mask is computed when the
constraint is built (a grammar that fails from the start is refused before generating), each
answer's grammar work is timed against `BUDGET_START_S` + `BUDGET_PER_TOKEN_S` a token
(`GrammarCostError` past it), and `check_regex` tries a schema's regex on its own first.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence

import numpy as np

from atlas_cli.backend.tokenizer import TextTokenizer
from atlas_cli.errors import GrammarCostError, GrammarError

log = logging.getLogger(__name__)

_TOKENIZERS: dict[int, tuple[TextTokenizer, GrammarTokenizer | None]] = {}
_MAX_TOKENIZERS = 4  # models a process keeps loaded at once (tests load a few)
# Grammar time one answer may spend (masks, checks, steps; CPU time of the thread, which
# llguidance computes on, so a busy machine is not the client's): room for a large grammar's
# first lexer states, then ~60x what a mask costs on a 49k vocabulary, every token
BUDGET_START_S = 1.0
BUDGET_PER_TOKEN_S = 0.02
# check_regex: a fifth of llguidance's default fuel for building a lexer's regexes (~50k a ms),
# a few steps of generation through the regex alone
REGEX_TRIAL_FUEL = 200_000
REGEX_TRIAL_STEPS = 3


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
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        self.matcher = llguidance.LLMatcher(gtok.ll, grammar, limits=_limits())
        if self.matcher.is_error():
            raise GrammarError(f"bad grammar: {_first_line(self.matcher.get_error())}")
        if prefix and not self.matcher.consume_tokens(gtok.ll.tokenize_str(prefix)):
            raise GrammarError(f"the answer's start {prefix!r} does not fit the grammar")
        self._bits = np.zeros((gtok.vocab_size + 31) // 32, dtype=np.int32)
        self.masks = 0  # masks computed (the draws the grammar rejected)
        self.spent_s = 0.0  # grammar time of this answer on the engine
        self.tokens = 0  # tokens taken
        self._compute_mask()  # builds the first lexer states here, before the engine runs

    def allows(self, token: int) -> bool:
        started = time.thread_time()
        ok = self.matcher.validate_tokens([token]) == 1
        self._charge(started)
        return ok

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` the grammar takes in a row from here (drafts to verify)."""
        if not tokens:
            return 0
        started = time.thread_time()
        n = self.matcher.validate_tokens(list(tokens))
        self._charge(started)
        return n

    def mask(self) -> np.ndarray:
        """(V,) bool: the tokens the grammar allows next. A grammar that allows nothing
        (never expected) allows the stop tokens, so generation ends instead of failing."""
        started = time.thread_time()
        self._compute_mask()
        self._charge(started)
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
        started = time.thread_time()
        if not self.matcher.consume_token(token):
            self._check()  # llguidance gave up on the grammar here (a limit of its own)
            # only a draw that skipped `allows` gets here: a caller bug, not a user error
            raise RuntimeError(f"token {token} does not fit the grammar: {self.error}")
        self.tokens += 1
        self._charge(started)

    def _compute_mask(self) -> None:
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        self._check()

    def _check(self) -> None:
        if self.matcher.is_error():
            raise GrammarError(f"the grammar failed: {_first_line(self.matcher.get_error())}")

    def _charge(self, started: float) -> None:
        self.spent_s += time.thread_time() - started
        allowed = BUDGET_START_S + BUDGET_PER_TOKEN_S * self.tokens
        if self.spent_s > allowed:
            raise GrammarCostError(
                f"the grammar took {self.spent_s:.2f} s over {self.tokens} tokens, more than "
                f"the {allowed:.2f} s an answer may spend on it; simplify the schema"
            )

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


def check_regex(gtok: GrammarTokenizer, pattern: str) -> None:
    """Refuse (GrammarCostError) a regex whose lexer llguidance cannot build cheaply: built
    alone on less fuel and stepped a few tokens, as generation would meet it. A regex that
    does not parse passes: the grammar's own compile names that error."""
    import llguidance

    limits = llguidance.LLParserLimits(initial_lexer_fuel=REGEX_TRIAL_FUEL, verbose_errors=False)
    grammar = llguidance.LLMatcher.grammar_from_regex(pattern)
    matcher = llguidance.LLMatcher(gtok.ll, grammar, limits=limits, log_level=0)
    if matcher.is_error():
        return
    bits = np.zeros((gtok.vocab_size + 31) // 32, dtype=np.int32)
    for _ in range(REGEX_TRIAL_STEPS):
        matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        allowed = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little"))
        allowed = allowed[allowed < gtok.vocab_size]
        if matcher.is_error() or not len(allowed) or not matcher.consume_token(int(allowed[-1])):
            break
    if matcher.is_error():
        raise GrammarCostError(
            f"the pattern {pattern[:60]!r} is too large for constrained decoding "
            f"({_first_line(matcher.get_error())})"
        )


def _limits():
    """llguidance's defaults, with errors in one line that do not quote the parser state."""
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


def new_constraint(tokenizer: TextTokenizer, lark: str, prefix: str = "") -> Constraint | None:
    """A fresh constraint for one answer; None where the tokenizer cannot be constrained."""
    gtok = grammar_tokenizer(tokenizer)
    return None if gtok is None else Constraint(gtok, lark, prefix)


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "unknown error"
