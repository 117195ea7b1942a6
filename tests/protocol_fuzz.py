"""Seeded hostile inputs for the keep-alive socket and for saved slot files, shared by
tests/test_protocol_fuzz.py and scripts/fuzz_protocols.py.

- `socket_case(seed)`: the bytes of one line a client could send a keep-alive worker: random
  bytes, text that is no JSON, JSON of the wrong shape, a run request with one field hostile
  (a value of another type or out of range, an unknown sampling key, a prompt past the context).
  `ask_worker(worker, line)` sends it over a socket pair to `worker.handle` and returns what came
  back; the worker must answer in its protocol and go on serving.
- `slot_case(good, seed)`: a saved slot file damaged one way (flipped or cut bytes, a member
  whose header lies, metadata or tokens of another type, arrays of another shape or dtype).
  Restoring it must be a SlotError (the server's 400), never anything else.
"""

from __future__ import annotations

import inspect
import io
import json
import random
import socket
import threading
import zipfile

import numpy as np

from atlas_cli.run_service import given_sampling
from tests.model_mutations import HOSTILE

GOOD_REQUEST = {
    "prompt": "hi", "system": None, "raw": False, "think": "on", "max_tokens": 3, "stop": [],
    "sampling": {"temperature": 0.0}, "stream": True,
}  # fmt: skip
SAMPLING_KEYS = list(inspect.signature(given_sampling).parameters)  # what a request may set
CASE_TIMEOUT_S = 30.0


def socket_case(seed: int) -> tuple[bytes, str]:
    """One line for a worker's socket, and what it is."""
    rng = random.Random(seed)
    kind = rng.randrange(8)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))), "random bytes"
    if kind == 1:
        return rng.choice([b"{", b"not json", b'{"op": "run", ', b"\xff\xfe{}"]), "not JSON"
    if kind == 2:
        value = rng.choice([[], 7, "run", None, [{"op": "run"}]])
        return json.dumps(value).encode(), f"JSON {type(value).__name__}"
    if kind == 3:
        message = rng.choice(
            [{"op": rng.choice(HOSTILE)}, {"op": "run"}, {"op": "run", "request": 5}]
        )
        return json.dumps(message, default=str).encode(), "a message of no known shape"
    request = dict(GOOD_REQUEST, sampling=dict(GOOD_REQUEST["sampling"]))
    if kind == 4:
        field = rng.choice(list(GOOD_REQUEST))
        request[field] = rng.choice(HOSTILE)
        what = f"{field} = {request[field]!r}"
    elif kind == 5:
        key = rng.choice([*SAMPLING_KEYS, "colour"])
        request["sampling"][key] = rng.choice(HOSTILE)
        what = f"sampling {key} = {request['sampling'][key]!r}"
    elif kind == 6:
        request["prompt"] = "word " * rng.choice([9000, 20000])
        what = "a prompt past the context"
    else:
        request[rng.choice(["extra", "op"])] = 1
        what = "an unknown field"
    text = json.dumps({"op": "run", "request": request}, default=str)
    return text.encode(), what


def ask_worker(worker, line: bytes) -> list[dict]:
    """Send `line` to `worker.handle` over a socket pair; the JSON messages it answered."""
    ours, theirs = socket.socketpair()
    thread = threading.Thread(target=worker.handle, args=(theirs,), daemon=True)
    thread.start()
    ours.settimeout(CASE_TIMEOUT_S)
    with ours:
        ours.sendall(line + b"\n")
        ours.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := ours.recv(65536):
            data += chunk
    thread.join(CASE_TIMEOUT_S)
    return [json.loads(x) for x in data.decode().splitlines() if x.strip()]


def slot_case(good: bytes, seed: int) -> tuple[bytes, str]:
    """A damaged copy of the slot file `good`, and what was done."""
    rng = random.Random(seed)
    kind = rng.randrange(6)
    if kind == 0:
        data = bytearray(good)
        for _ in range(rng.randrange(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return bytes(data), "flipped bits"
    if kind == 1:
        return good[: rng.randrange(len(good))], "cut short"
    with np.load(io.BytesIO(good), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    name = rng.choice(sorted(arrays))
    if kind == 2:
        arrays[name] = arrays[name].reshape(-1)[: max(arrays[name].size // 2, 1)]
        what = f"{name} of another shape"
    elif kind == 3:
        arrays[name] = arrays[name].astype(rng.choice([np.float16, np.int32, np.uint8]))
        what = f"{name} of another dtype"
    elif kind == 4:
        value = rng.choice(HOSTILE)
        meta = json.loads(arrays["meta"].tobytes())
        meta[rng.choice(["format", "model", "prompt_len"])] = value
        arrays["meta"] = np.frombuffer(json.dumps(meta, default=str).encode(), np.uint8)
        what = f"metadata value {value!r}"
    else:
        arrays["ids"] = np.asarray(rng.choice([[-1], [2**40], [], [0.5]]))
        what = f"tokens {arrays['ids'].tolist()!r}"
    out = io.BytesIO()
    np.savez(out, **arrays)
    return out.getvalue(), what


def lying_header(good: bytes) -> bytes:
    """The slot file with its first member's npy header asking for 400 GB."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(good)) as src, zipfile.ZipFile(out, "w") as dst:
        for i, info in enumerate(src.infolist()):
            data = src.read(info)
            if i == 0:
                head = io.BytesIO()
                header = {"descr": "<f4", "fortran_order": False, "shape": (10**11,)}
                np.lib.format.write_array_header_1_0(head, header)
                data = head.getvalue() + b"\0" * 64
            dst.writestr(info, data)
    return out.getvalue()
