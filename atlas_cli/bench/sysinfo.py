"""What a benchmark record says about where it ran: atlas version and commit, device, driver,
CPU, numeric libraries, and the model's size and parameter count (llama-bench's columns)."""

from __future__ import annotations

import json
import math
import platform
import subprocess
from datetime import UTC, datetime
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

from atlas_cli import __version__

BACKEND_LABELS = {"cpu": "CPU", "cpu-ref": "CPU"}
DISTRIBUTION = "atlas-cli"


@lru_cache(maxsize=1)
def git_commit() -> str | None:
    """The commit atlas was built from: its git checkout's, else what pip recorded when it
    installed from one (direct_url.json: a git URL's commit, or the local folder it came from);
    None for a release from the package index (its version says which)."""
    checkout = Path(__file__).resolve().parents[2]  # a source tree: pyproject.toml beside us
    if (checkout / "pyproject.toml").is_file():
        return _head(checkout)
    try:
        recorded = json.loads(
            metadata.distribution(DISTRIBUTION).read_text("direct_url.json") or "{}"
        )
    except (metadata.PackageNotFoundError, ValueError, OSError):
        return None
    if isinstance(recorded.get("vcs_info"), dict) and recorded["vcs_info"].get("commit_id"):
        return str(recorded["vcs_info"]["commit_id"])[:12]
    url = recorded.get("url", "")
    return _head(Path(url.removeprefix("file://"))) if url.startswith("file://") else None


def _head(folder: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(folder), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and commit else None


@lru_cache(maxsize=1)
def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def blas_info() -> dict[str, Any]:
    """The BLAS numpy calls and its thread count (threadpoolctl), for the CPU backends."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return {}
    for entry in threadpool_info():
        if entry.get("user_api") == "blas":
            return {
                "blas": f"{entry.get('internal_api')} {entry.get('version') or ''}".strip(),
                "n_threads": entry.get("num_threads"),
            }
    return {}


def environment(device: str) -> dict[str, Any]:
    """The fields every record carries about the run's software and hardware."""
    import numpy

    info = {
        "atlas_version": __version__,
        "git_commit": git_commit(),
        "test_time": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": device,
        "backend": BACKEND_LABELS.get(device, device.upper()),
        "device_name": cpu_name() if device.startswith("cpu") else device,
        "driver": None,  # the CPU backends have none; GPU backends report theirs
        "cpu_info": cpu_name(),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
    }
    info.update(blas_info())
    return info


def model_facts(model) -> dict[str, Any]:
    """llama-bench's model columns: a `arch size ftype` label, weight bytes and parameter count."""
    info = model.info
    size, params = _gguf_sizes(info.path) if info.format == "gguf" else (None, None)
    if params is None:
        params = _count_params(model)
    if size is None:
        files = [info.path] if info.path.is_file() else sorted(info.path.glob("*.safetensors"))
        size = sum(f.stat().st_size for f in files)
    return {
        "model": f"{info.architecture} {size_label(params)} {info.file_type}".strip(),
        "model_name": info.name,
        "model_filename": str(info.path),
        "model_type": info.architecture,
        "model_size": size,
        "model_n_params": params,
        "file_type": info.file_type,
    }


def _gguf_sizes(path: Path) -> tuple[int | None, int | None]:
    """Tensor bytes and parameter count from the (cached) GGUF header: what llama-bench shows."""
    from atlas_cli.backend.loaders import gguf
    from atlas_cli.store import paths

    try:
        gf = gguf.open_gguf(path, cache_dir=paths.cache_dir())
    except Exception:  # a header we cannot read again is only a missing column
        return None, None
    tensors = gf.tensors.values()
    return sum(t.nbytes for t in tensors), sum(math.prod(t.shape) for t in tensors)


def _count_params(model) -> int | None:
    weights = getattr(getattr(model.engine, "model", None), "w", None)
    if not isinstance(weights, dict):
        return None
    seen: set[int] = set()
    total = 0
    for w in weights.values():
        if id(w) in seen or not hasattr(w, "shape"):
            continue  # tied embeddings are one tensor under two names
        seen.add(id(w))
        total += math.prod(w.shape)
    return total


def size_label(params: int | None) -> str:
    if not params:
        return ""
    if params < 1e9:
        return f"{round(params / 1e6)}M"
    return f"{params / 1e9:.1f}".rstrip("0").rstrip(".") + "B"


def format_size(nbytes: int) -> str:
    """llama-bench's size column: MiB under 1 GiB, GiB above."""
    if nbytes < 1024**3:
        return f"{nbytes / 1024**2:.2f} MiB"
    return f"{nbytes / 1024**3:.2f} GiB"


def format_params(n: int | None) -> str:
    if n is None:
        return "?"
    if n < 1e9:
        return f"{n / 1e6:.2f} M"
    return f"{n / 1e9:.2f} B"
