"""What `/set` can change: the sampling options shared with `atlas run`, plus display switches.

Values arrive as text from the REPL; `apply` parses and validates one and returns new settings,
so a bad value leaves the old settings in place.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from atlas_cli.backend.sample import SamplingOverrides, SamplingParams
from atlas_cli.errors import UsageError

THINK_MODES = ("on", "hidden", "off")  # on: shown dimmed; hidden: not shown; off: ask not to think
SWITCH_VALUES = ("on", "off")


_SAMPLER = SamplingParams()  # chat starts from the sampler's own defaults


@dataclass(frozen=True)
class ChatSettings:
    temperature: float = _SAMPLER.temperature
    top_k: int = _SAMPLER.top_k
    top_p: float = _SAMPLER.top_p
    min_p: float = _SAMPLER.min_p
    repeat_penalty: float = _SAMPLER.repeat_penalty
    seed: int | None = _SAMPLER.seed
    reasoning_budget: int | None = None  # tokens of thought before an answer is forced
    max_tokens: int = 512
    stop: tuple[str, ...] = ()
    verbose: bool = False
    think: str = "on"
    markdown: bool = False

    def sampling(self) -> SamplingOverrides:
        """What `Model.generate`'s sampler takes; checked on construction."""
        return SamplingOverrides(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            repeat_penalty=self.repeat_penalty,
            seed=self.seed,
            reasoning_budget=self.reasoning_budget,
        )

    def options(self) -> dict[str, Any]:
        """Everything worth saving with a conversation (JSON-ready)."""
        out = dataclasses.asdict(self)
        out["stop"] = list(self.stop)
        return out

    def validate(self) -> ChatSettings:
        self.sampling()  # raises UsageError on out-of-range values
        if self.max_tokens < 1:
            raise UsageError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.think not in THINK_MODES:
            raise UsageError(f"think must be one of {', '.join(THINK_MODES)}, got {self.think!r}")
        return self


def _number(kind: type) -> Callable[[str], Any]:
    def parse(text: str):
        try:
            return kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise UsageError(f"expected {what}, got {text!r}") from None

    return parse


def _switch(text: str) -> bool:
    value = text.strip().lower()
    if value in ("on", "true", "yes", "1"):
        return True
    if value in ("off", "false", "no", "0"):
        return False
    raise UsageError(f"expected on or off, got {text!r}")


def _seed(text: str) -> int | None:
    if text.strip().lower() in ("none", "random", "off", "-1"):
        return None
    return _number(int)(text)


def _budget(text: str) -> int | None:
    if text.strip().lower() in ("none", "off", "-1"):
        return None
    return _number(int)(text)


def _stop(text: str) -> tuple[str, ...]:
    if text.strip().lower() in ("none", "off", ""):
        return ()
    try:
        return tuple(shlex.split(text))
    except ValueError as exc:
        raise UsageError(f"stop: {exc}") from None


def _think(text: str) -> str:
    value = text.strip().lower()
    aliases = {"show": "on", "true": "on", "hide": "hidden", "false": "off"}
    value = aliases.get(value, value)
    if value not in THINK_MODES:
        raise UsageError(f"think: expected one of {', '.join(THINK_MODES)}, got {text!r}")
    return value


@dataclass(frozen=True)
class Param:
    name: str
    parse: Callable[[str], Any]
    help: str
    values: tuple[str, ...] = ()  # what tab completion offers for the value


PARAMS = {
    p.name: p
    for p in (
        Param("temperature", _number(float), "sampling temperature; 0 is greedy"),
        Param("top_k", _number(int), "keep the k most likely tokens (0: off)"),
        Param("top_p", _number(float), "nucleus sampling mass"),
        Param("min_p", _number(float), "drop tokens below min_p × the best"),
        Param("repeat_penalty", _number(float), "penalise recently seen tokens (1.0: off)"),
        Param("seed", _seed, "random seed (none: a fresh one each turn)", ("none",)),
        Param(
            "reasoning_budget",
            _budget,
            "tokens of thought before it answers (none: no limit)",
            ("none",),
        ),
        Param("max_tokens", _number(int), "most tokens per answer"),
        Param("stop", _stop, "stop strings, shell-quoted (none: clear)", ("none",)),
        Param("verbose", _switch, "a stats line after each answer", SWITCH_VALUES),
        Param("think", _think, "reasoning: on (dimmed), hidden, off (ask not to)", THINK_MODES),
        Param("markdown", _switch, "render finished answers as Markdown", SWITCH_VALUES),
    )
}


def find_param(text: str) -> Param | None:
    """The parameter `text` names (any case, `-` for `_`), or None."""
    return PARAMS.get(text.strip().lower().replace("-", "_"))


def param_name(text: str) -> str:
    param = find_param(text)
    if param is None:
        raise UsageError(f"unknown parameter {text!r}; one of: {', '.join(PARAMS)}")
    return param.name


def apply(settings: ChatSettings, name: str, value: str) -> ChatSettings:
    """`settings` with `name` set from the text `value`, validated."""
    param = PARAMS[param_name(name)]
    return dataclasses.replace(settings, **{param.name: param.parse(value)}).validate()


def from_options(settings: ChatSettings, options: dict[str, Any]) -> ChatSettings:
    """Settings restored from a saved conversation; unknown keys are ignored."""
    known = {f.name for f in dataclasses.fields(ChatSettings)}
    values = {k: v for k, v in options.items() if k in known}
    if "stop" in values:
        values["stop"] = tuple(values["stop"] or ())
    try:
        return dataclasses.replace(settings, **values).validate()
    except TypeError as exc:
        raise UsageError(f"bad options: {exc}") from None


def show_value(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None:
        return "none"
    if isinstance(value, tuple):
        return " ".join(shlex.quote(s) for s in value) if value else "none"
    return str(value)
