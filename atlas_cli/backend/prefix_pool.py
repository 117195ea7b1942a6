"""Several cached sequences at once: the prefix pool behind `Engine.prefill`.

Agent harnesses interleave conversations (sub-agents, title and summary calls), so one cache
that only remembers the previous request re-prefills every long prompt. The pool keeps several
`Slot`s, each a whole cache (KV; for hybrid models the linear-attention state and its
checkpoints) with the tokens it holds, and sends each prompt to the slot that can keep most of
it (`choose`):

- the prompt extends a slot, or leaves it only inside the reply generated last time (the next
  turn re-renders that reply): the slot is taken over in place;
- the prompt leaves a slot inside that slot's last *prompt* (another conversation sharing a
  system prompt, an edited history): the reusable prefix is copied into a new slot (a fork),
  and the original stays for its own conversation;
- nothing reusable: an empty slot.

A linear-attention state cannot be cut at any position, so "reusable" is what the cache can
return to (`Cache.reusable`): the engine checkpoints it at message starts and before each
prompt's last token, never inside a reply a later prompt may replace. Slots are evicted least
recently used first, by bytes, down to the budget (`--cache-size`); the slot in use stays.

Slots can be saved to and restored from a file (llama-server's `/slots?action=save|restore`,
inside the folder `--slot-save-path` names): a `.npz` of the cache's arrays, its tokens and a
fingerprint of the model, read back without pickle.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import os
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from atlas_cli.backend.cache import Cache
from atlas_cli.errors import SlotError, SlotNotFoundError
from atlas_cli.store import paths

# the special tokens that open a message in the chat formats we know (ChatML, Llama 3, Gemma)
MESSAGE_START_TEXTS = ("<|im_start|>", "<|start_header_id|>", "<start_of_turn>")
SLOT_FORMAT = 1
# Default budgets, each at most a quarter of the memory available at load: `atlas serve`
# caches every client's conversations (8 GiB, llama-server's --cache-ram default); `atlas run`,
# `chat` and the keep-alive worker hold one user's last few (1 GiB: a dozen 8K conversations of
# a 1.5B model, one long one of a 27B).
SERVE_BUDGET = 8 << 30
RUN_BUDGET = 1 << 30
DEFAULT_SHARE = 4


@dataclass(eq=False)
class Slot:
    id: int
    cache: Cache
    ids: list[int] = field(default_factory=list)  # the tokens whose state `cache` holds
    prompt_len: int = 0  # the last prompt prefilled here: leaving it before its end forks
    mtp: Cache | None = None  # the speculator's MTP cache for this sequence
    used: int = 0  # LRU clock

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes + (self.mtp.nbytes if self.mtp is not None else 0)


class PrefixPool:
    def __init__(self, new_cache: Callable[[], Cache], budget: int):
        self.new_cache = new_cache
        self.budget = budget
        self.on_evict: Callable[[Slot], None] | None = None  # an evicted slot, before it goes
        self._clock = itertools.count(1)
        self.slots: list[Slot] = []
        self.current = self.add(new_cache())

    def add(self, cache: Cache, ids: Sequence[int] = (), slot_id: int | None = None) -> Slot:
        """A new slot (replacing the one of that id, if any), used now."""
        if slot_id is None:
            slot_id = max((s.id for s in self.slots), default=-1) + 1
        self.slots = [s for s in self.slots if s.id != slot_id]
        slot = Slot(slot_id, cache, list(ids), prompt_len=len(ids), used=next(self._clock))
        self.slots.append(slot)
        return slot

    def get(self, slot_id: int) -> Slot:
        for slot in self.slots:
            if slot.id == slot_id:
                return slot
        have = ", ".join(str(s.id) for s in self.slots)
        raise SlotNotFoundError(f"there is no slot {slot_id} (slots: {have})")

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots)

    def best_reuse(self, ids: Sequence[int], limit: int) -> int:
        """How many of `ids[:limit]` the best slot could keep (what `choose` would reuse)."""
        target = np.asarray(ids[:limit], np.int64)
        return max(s.cache.reusable(common_prefix(s.ids, target)) for s in self.slots)

    def choose(self, ids: Sequence[int], limit: int) -> tuple[Slot, int]:
        """Make the slot for the prompt `ids` current; return it and how many of its positions
        to keep (at most `limit`: the last prompt token is always recomputed for its logits)."""
        target = np.asarray(ids[:limit], np.int64)
        best, keep, in_place = self.current, 0, True
        rank = (-1, False, 0)
        for slot in self.slots:
            common = common_prefix(slot.ids, target)
            reusable = slot.cache.reusable(common)
            # the same prompt again stops one short of it: that is not leaving it
            fits = common >= slot.prompt_len - 1
            if (reusable, fits, slot.used) > rank:
                rank, best, keep, in_place = (reusable, fits, slot.used), slot, reusable, fits
        if keep == 0:
            best = next((s for s in self.slots if not s.ids), None) or self.add(self.new_cache())
        elif not in_place and 2 * best.nbytes <= self.budget:
            best = self._fork(best, keep)
        elif not in_place and self.on_evict is not None:
            self.on_evict(best)  # no room for a copy: its conversation goes before it is cut
        best.used = next(self._clock)
        self.current = best
        return best, keep

    def _fork(self, source: Slot, keep: int) -> Slot:
        slot = self.add(source.cache.clone(keep), source.ids[:keep])
        if source.mtp is not None:
            slot.mtp = source.mtp.clone(max(keep - 1, 0))
        return slot

    def trim(self) -> None:
        """Evict the least recently used slots (never the current one) down to the budget."""
        total = self.nbytes
        for slot in sorted(self.slots, key=lambda s: s.used):
            if total <= self.budget:
                break
            if slot is not self.current:
                self.slots.remove(slot)
                total -= slot.nbytes
                if self.on_evict is not None:
                    self.on_evict(slot)

    def clear(self) -> None:
        """Forget every sequence; the current slot's cache is kept, empty."""
        slot = self.current
        slot.cache.truncate(0)
        slot.ids, slot.prompt_len = [], 0
        self.slots = [slot]

    def erase(self, slot_id: int) -> int:
        """Drop one slot; returns how many tokens it held."""
        slot = self.get(slot_id)
        self.slots.remove(slot)
        if slot is self.current:
            self.current = self.add(self.new_cache())
        return len(slot.ids)


def common_prefix(ids: Sequence[int], target: np.ndarray) -> int:
    n = min(len(ids), len(target))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(ids[:n], np.int64) != target[:n])
    return int(diff[0]) if len(diff) else n


def message_start_ids(tokenizer) -> frozenset[int]:
    """The ids of the tokens that open a message, for this tokenizer's chat format (none
    without a tokenizer: an engine driven by token ids alone)."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None:
        return frozenset()
    found = (backend.token_to_id(text) for text in MESSAGE_START_TEXTS)
    return frozenset(i for i in found if i is not None)


def boundaries(ids: Sequence[int], start: int, end: int, marks: frozenset[int]) -> list[int]:
    """Message starts in (start, end) to checkpoint at: the first (the end of a system prompt
    other conversations share) and the last two (where this conversation's next turn forks)."""
    if not marks or end <= start + 1:
        return []
    found = np.flatnonzero(np.isin(np.asarray(ids[start + 1 : end]), list(marks))) + start + 1
    return sorted({int(p) for p in [*found[:1], *found[-2:]]})


def default_budget(cap: int) -> int:
    """`cap`, or a quarter of the memory available now where that is less (Linux's
    MemAvailable; else free pages)."""
    return min(cap, available_memory() // DEFAULT_SHARE)


def available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62  # unknown: the cap decides


def fingerprint(model) -> str:
    """What a saved slot must match: the architecture, its config and the final norm's
    weights (two fine-tunes of one config differ there)."""
    h = hashlib.sha256(f"{type(model).__name__}|{model.args!r}".encode())
    norm = model.w.get("model.norm.weight")
    if norm is not None:
        h.update(np.ascontiguousarray(np.asarray(norm, np.float32)).tobytes())
    return h.hexdigest()[:32]


# -- slot files --------------------------------------------------------------------------------


def save_slot(slot: Slot, path: Path, model_id: str) -> int:
    """Write `slot` to `path` (atomically); returns the bytes written."""
    return write_slot(slot_arrays(slot, model_id), path)


def slot_arrays(slot: Slot, model_id: str) -> dict[str, np.ndarray]:
    """What a slot file holds, as host arrays (taken on the engine's thread: a device cache
    is copied out here)."""
    arrays = {f"cache.{k}": v for k, v in slot.cache.export().items()}
    if slot.mtp is not None:
        arrays |= {f"mtp.{k}": v for k, v in slot.mtp.export().items()}
    meta = {"format": SLOT_FORMAT, "model": model_id, "prompt_len": slot.prompt_len}
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    arrays["ids"] = np.asarray(slot.ids, np.int64)
    return arrays


def write_slot(arrays: dict[str, np.ndarray], path: Path) -> int:
    """`slot_arrays` to `path`, atomically (a reader never sees half of it, and two processes
    writing the same name do not share a partial file); returns the bytes written."""
    with paths.store_writes("make the atlas cache folder writable, or set ATLAS_HOME"):
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
        try:
            with open(tmp, "wb") as f:
                np.savez(f, **arrays)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
    return path.stat().st_size


def check_declared_sizes(archive: zipfile.ZipFile, max_bytes: int) -> None:
    """Refuse, before anything is allocated, an npz whose arrays declare more than `max_bytes`
    in all, or more than their member holds: numpy allocates what an array's header says (a
    2 MB file asked for 715 GiB) and a deflated member inflates past the file's size."""
    total = 0
    for info in archive.infolist():
        total += info.file_size
        with archive.open(info) as member:
            version = np.lib.format.read_magic(member)
            read_header = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, _, dtype = read_header(member)
        if math.prod(shape) * dtype.itemsize > info.file_size:
            raise ValueError(f"{info.filename} declares more than it holds")
    if total > max_bytes:
        raise ValueError(f"its arrays hold {total:,} bytes, more than the prefix cache's")


def read_slot(path: Path, model_id: str, max_bytes: int) -> tuple[dict, dict, dict, list[int]]:
    """A saved slot's meta, cache arrays, MTP arrays and tokens, checked before use."""
    if not path.is_file():
        raise SlotNotFoundError(f"there is no saved slot {path.name!r} in {path.parent}")
    size = path.stat().st_size
    if size > max_bytes:
        raise SlotError(
            f"{path.name} holds {size:,} bytes, more than the prefix cache's {max_bytes:,}; "
            "raise --cache-size to restore it"
        )
    try:
        with np.load(path, allow_pickle=False) as z:
            check_declared_sizes(z.zip, max_bytes)
            arrays = {k: z[k] for k in z.files}
        meta = json.loads(arrays.pop("meta").tobytes())
        ids = [int(i) for i in arrays.pop("ids").reshape(-1)]
        if not isinstance(meta, dict) or type(meta.get("prompt_len")) is not int:
            raise ValueError("its metadata is not a slot's")
    except Exception as exc:  # noqa: BLE001 - any damage to the file makes it no slot (numpy's
        # header parser alone raises ValueError, SyntaxError or tokenize's TokenError)
        raise SlotError(f"{path.name} is not a saved slot ({exc})") from None
    if meta.get("format") != SLOT_FORMAT or meta.get("model") != model_id:
        raise SlotError(f"{path.name} was saved from another model or atlas version")
    cache = {k[6:]: v for k, v in arrays.items() if k.startswith("cache.")}
    mtp = {k[4:]: v for k, v in arrays.items() if k.startswith("mtp.")}
    return meta, cache, mtp, ids
