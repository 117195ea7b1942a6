"""Checks every model file passes before anything is allocated, shared by GGUF and safetensors.

A tensor table (name, byte range, shape, element size) is checked against the real file (inside
it, no two tensors sharing bytes, a byte count that matches the shape and the format's blocks),
and the shapes against what the config implies (the model class's `weight_shapes`). Every
failure is a CorruptModelError / UnsupportedModelError that names the file, the tensor or field
and what was expected. Nothing here reads a count from the file and then allocates by it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from atlas_cli.errors import CorruptModelError

# No model tensor has more than 5 dimensions (a 3-D conv's weight); numpy refuses past 64, and
# a long shape list would only make every message that names the shape unreadable.
MAX_DIMS = 8


@dataclass(frozen=True)
class Span:
    """One tensor's bytes in a file: [start, end) absolute offsets."""

    name: str
    start: int
    end: int


def check_spans(file: str, spans: Iterable[Span], size: int) -> None:
    """Every span inside the file's `size` bytes, and no two sharing a byte (a tensor written
    over another is a damaged file, even if each alone would read)."""
    ordered = sorted(spans, key=lambda s: (s.start, s.end))
    for span in ordered:
        if span.start < 0 or span.end < span.start:
            raise CorruptModelError(
                f"{file}: tensor {span.name} has byte range [{span.start:,}, {span.end:,}) "
                "(expected 0 <= start <= end); the file is damaged"
            )
        if span.end > size:
            raise CorruptModelError(
                f"{file}: file is truncated (tensor {span.name} ends at byte {span.end:,} but "
                f"the file has {size:,} bytes); download it again"
            )
    previous = None
    for span in ordered:
        if span.start == span.end:
            continue  # an empty tensor owns no bytes
        if previous is not None and span.start < previous.end:
            raise CorruptModelError(
                f"{file}: tensors {previous.name} and {span.name} overlap (bytes "
                f"{span.start:,}-{min(span.end, previous.end):,}; expected each tensor to "
                "start at or after the end of the one before); the file is damaged"
            )
        previous = span


def block_bytes(
    file: str, name: str, shape: tuple[int, ...], block_elems: int, bytes_per_block: int
) -> int:
    """The bytes a tensor of `shape` takes in blocks of `block_elems` elements: its rows
    (the last numpy dimension) must hold whole blocks."""
    if len(shape) > MAX_DIMS:
        raise CorruptModelError(
            f"{file}: tensor {name} has {len(shape):,} dimensions (expected at most {MAX_DIMS}); "
            "the file is damaged"
        )
    if any(type(d) is not int or d < 0 for d in shape):
        raise CorruptModelError(
            f"{file}: tensor {name} has shape {list(shape)} (expected non-negative integers)"
        )
    if shape and shape[-1] % block_elems:
        raise CorruptModelError(
            f"{file}: tensor {name} has rows of {shape[-1]} elements, which is not a "
            f"multiple of its format's block of {block_elems} (expected a multiple of "
            f"{block_elems}); the file is damaged"
        )
    return math.prod(shape) // block_elems * bytes_per_block


def check_shapes(
    source: str,
    shapes: Mapping[str, tuple[int, ...]],
    required: Mapping[str, list[tuple[int, ...]]],
    optional: Mapping[str, list[tuple[int, ...]]],
) -> None:
    """Each required tensor present, and every listed tensor in one of its expected shapes."""
    for name, expected in required.items():
        if name not in shapes:
            raise CorruptModelError(
                f"{source}: tensor {name} is missing (expected shape {_shape_text(expected)} "
                "from the config); the file is incomplete or not this architecture"
            )
    for name, expected in {**optional, **required}.items():
        if name in shapes and tuple(shapes[name]) not in expected:
            raise CorruptModelError(
                f"{source}: tensor {name} has shape {list(shapes[name])}, expected "
                f"{_shape_text(expected)} from the config; the file and its config disagree"
            )


def _shape_text(shapes: list[tuple[int, ...]]) -> str:
    return " or ".join(str(list(s)) for s in shapes)


def check_vocab(source: str, vocab_size: int, tokenizer_size: int, special_ids: dict) -> None:
    """Every id the tokenizer can produce must have a row in the embedding."""
    if tokenizer_size > vocab_size:
        raise CorruptModelError(
            f"{source}: vocab_size is {vocab_size:,} but the tokenizer has {tokenizer_size:,} "
            f"tokens (expected vocab_size >= {tokenizer_size:,})"
        )
    for field, token_id in special_ids.items():
        if token_id is not None and not 0 <= token_id < vocab_size:
            raise CorruptModelError(
                f"{source}: {field} is {token_id} (expected a token id below the vocabulary "
                f"size {vocab_size:,})"
            )
