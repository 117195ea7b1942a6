"""`atlas chat`: an interactive REPL over a loaded model (prompt-toolkit input, rich output)."""

from atlas_cli.chat.repl import ChatOptions, ChatREPL, run_chat
from atlas_cli.chat.settings import ChatSettings

__all__ = ["ChatOptions", "ChatREPL", "ChatSettings", "run_chat"]
