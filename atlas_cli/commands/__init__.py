"""The `atlas` commands, one module per group; `atlas_cli.cli` assembles them into the app.

A command parses its flags (the shared ones come from `options`), calls a library function and
prints; user errors are mapped to one line and an exit code in one place (`errors`). Nothing
heavy is imported at module level here: `atlas --help` loads every one of these files.
"""
