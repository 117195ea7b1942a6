"""`atlas chat`: an interactive REPL over a loaded model (prompt-toolkit input, rich output).

repl.py          run_chat (the entry) and ChatREPL: the loop and one turn of it
handlers.py      what each /command does (mixed into ChatREPL)
commands.py      the /commands as data: names, help, prefix lookup, tab completion
input.py         reading lines: prompt-toolkit session and keys, a pipe, history file
render.py        drawing: the streamed reply, stats lines, tables, model labels
conversation.py  the messages, their JSON file, fitting them into the context
settings.py      what /set changes, parsed and validated
"""

from atlas_cli.chat.repl import ChatOptions, ChatREPL, run_chat
from atlas_cli.chat.settings import ChatSettings

__all__ = ["ChatOptions", "ChatREPL", "ChatSettings", "run_chat"]
