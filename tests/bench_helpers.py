"""Helpers shared by the bench tests: the real MLPerf trajectory file and small synthetic ones."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TRAJECTORY_NAME = "shared/data/mlperf-edge-agentic/agentic_coding_2.5h.jsonl"


def trajectory_file() -> Path:
    """The real trajectory file: shared/ sits beside the clone in CI (../shared), a few levels up
    for a git worktree. Missing in CI is a failure, elsewhere a skip."""
    for base in (REPO, *REPO.parents):
        candidate = base / TRAJECTORY_NAME
        if candidate.is_file():
            return candidate
    message = f"trajectory file not found: expected ../{TRAJECTORY_NAME} beside the repository"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Execute a bash command",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    }
]


def tiny_conversation(cid: str, steps: int = 2) -> list[dict]:
    """A short, valid conversation: user, then (assistant tool call, tool result) x steps."""
    rows = [
        {
            "conversation_id": cid,
            "turn": 1,
            "role": "user",
            "content": "List the files.",
            "system": "You are a helpful assistant.",
            "tools": TOOLS,
        }
    ]
    for i in range(steps):
        call_id = f"call:{i}"
        rows.append(
            {
                "conversation_id": cid,
                "turn": len(rows) + 1,
                "role": "assistant",
                "reasoning_content": f"Step {i}: look around.",
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "bash", "arguments": json.dumps({"command": "ls"})},
                    }
                ],
            }
        )
        rows.append(
            {
                "conversation_id": cid,
                "turn": len(rows) + 1,
                "role": "tool",
                "tool_results": [{"tool_call_id": call_id, "content": f"file{i}.py"}],
                "delay_seconds": 0.1,
            }
        )
    return rows


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
