"""Errors a user can cause. Each carries a message that says what to do next.

The CLI prints `atlas: error: <message>` and exits non-zero; a traceback appears only with
ATLAS_DEBUG=1.
"""

from __future__ import annotations


class AtlasError(Exception):
    """Base class: anything a user can cause and fix."""

    exit_code = 1


class ModelNotFoundError(AtlasError):
    """An unknown model name or a path that does not exist."""


class CorruptModelError(AtlasError):
    """A model file that is truncated, damaged or not what its name says."""


class UnsupportedModelError(AtlasError):
    """A valid file whose architecture or tensor types atlas cannot run (yet)."""


class ContextOverflowError(AtlasError):
    """A prompt that does not fit the model's context window."""


class DownloadError(AtlasError):
    """A download that failed: network down, bad hash, full disk."""


class StoreError(AtlasError):
    """The model store cannot be changed: a read-only home, no permission, or a manifest that
    names files outside the store."""


class TemplateError(AtlasError):
    """A chat template that fails to render."""


class DeviceError(AtlasError):
    """A requested device that is missing or cannot be used."""


class UsageError(AtlasError):
    """A bad flag value or combination."""

    exit_code = 2


class RecipeError(AtlasError):
    """A recipe file that does not match the schema (names the file and the field)."""


class ModelTooLargeError(AtlasError):
    """A model whose weights and KV cache do not fit the device's memory."""


class GrammarError(AtlasError):
    """A grammar or JSON schema that constrained decoding cannot compile."""


class GrammarCostError(GrammarError):
    """A grammar that costs constrained decoding more time than one answer may spend."""


class SlotError(AtlasError):
    """A saved prefix-cache slot that is missing, badly named, too large or from another model."""


class SlotNotFoundError(SlotError):
    """A slot id or saved slot file that does not exist."""
