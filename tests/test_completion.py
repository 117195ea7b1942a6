"""Shell completion: the scripts in completions/ match the CLI, parse in each shell, and
complete commands, flags and model names when the shell runs them."""

from __future__ import annotations

import enum
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import pytest
import typer
from typer.testing import CliRunner

from atlas_cli import cli, completion, completion_cache, entry
from atlas_cli.cli import app

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = {shell: ROOT / "completions" / name for shell, name in completion.FILES.items()}


@pytest.mark.parametrize("shell", completion.SHELLS)
def test_scripts_match_the_cli(shell):
    printed = CliRunner().invoke(app, ["completion", shell])
    assert printed.exit_code == 0
    assert printed.output == completion.script(shell)
    assert SCRIPTS[shell].read_text() == printed.output, (
        f"completions/{SCRIPTS[shell].name} is stale; regenerate it: "
        f"python -m atlas_cli completion {shell} > completions/{SCRIPTS[shell].name}"
    )


def test_unknown_shell_is_a_usage_error():
    result = CliRunner().invoke(app, ["completion", "tcsh"])
    assert result.exit_code == 2 and "unknown shell 'tcsh'" in result.output


@pytest.mark.parametrize("shell", completion.SHELLS)
def test_scripts_parse(shell):
    exe = shutil.which(shell)
    if exe is None:
        pytest.skip(f"{shell} is not installed")
    check = subprocess.run([exe, "-n", str(SCRIPTS[shell])], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


@pytest.fixture(scope="module")
def atlas_on_path(tmp_path_factory) -> dict[str, str]:
    """An `atlas` executable (this checkout, this Python) first on PATH, as after install."""
    bin_dir = tmp_path_factory.mktemp("bin")
    exe = bin_dir / "atlas"
    exe.write_text(
        f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(ROOT)!r})\n"
        "from atlas_cli.cli import main\nmain()\n"
    )
    exe.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    env["ATLAS_HOME"] = str(tmp_path_factory.mktemp("home"))
    (Path(env["ATLAS_HOME"]) / "models" / "my-local-model").mkdir(parents=True)
    return env


def bash_complete(line: str, env: dict[str, str]) -> list[str]:
    """What bash offers for `line` (the cursor at its end), through completions/atlas.bash."""
    program = (
        f"source {SCRIPTS['bash']}\n"
        f"COMP_LINE={line!r}; COMP_POINT=${{#COMP_LINE}}\n"
        f"read -ra COMP_WORDS <<< {line!r}\n"
        '[[ "$COMP_LINE" == *" " ]] && COMP_WORDS+=("")\n'
        "COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 ))\n"
        '_atlas_completion atlas "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD-1]}"\n'
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    done = subprocess.run(["bash", "-c", program], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    return [w for w in done.stdout.splitlines() if w]


def test_bash_completes_commands_flags_and_names(atlas_on_path):
    if shutil.which("bash") is None:
        pytest.skip("bash is not installed")
    assert "chat" in bash_complete("atlas ch", atlas_on_path)
    assert bash_complete("atlas chat --tem", atlas_on_path) == ["--temperature"]
    assert "--no-history" in bash_complete("atlas chat --", atlas_on_path)
    names = bash_complete("atlas chat ", atlas_on_path)
    assert "smollm2-135m" in names and "my-local-model" in names  # embedded + installed
    assert bash_complete("atlas run smol", atlas_on_path) == ["smollm2-135m"]
    assert bash_complete("atlas completion f", atlas_on_path) == ["fish"]


def test_variants_after_a_colon_and_rm_offers_only_what_is_downloaded(atlas_on_path):
    """`atlas pull qwen3-8b:<Tab>` lists the recipe's variants (bash replaces only what follows
    the colon); `atlas rm <Tab>` what is in the store, not every recipe."""
    if shutil.which("bash") is None:
        pytest.skip("bash is not installed")
    assert set(bash_complete("atlas pull qwen3-8b:", atlas_on_path)) == {"bf16", "q4_k_m"}
    assert bash_complete("atlas show qwen3-8b:q4", atlas_on_path) == ["q4_k_m"]
    assert bash_complete("atlas rm ", atlas_on_path) == ["my-local-model"]
    manifests = Path(atlas_on_path["ATLAS_HOME"]) / "manifests" / "my-local-model"
    manifests.mkdir(parents=True, exist_ok=True)
    (manifests / "q8_0.json").write_text("{}")
    assert bash_complete("atlas rm my-local-model:", atlas_on_path) == ["q8_0"]


def test_bench_completes_the_default_subcommand_flags(atlas_on_path):
    """`atlas bench MODEL ...` runs `bench throughput MODEL ...`; Tab sees the same words."""
    if shutil.which("bash") is None:
        pytest.skip("bash is not installed")
    assert {"agentic", "coherence", "throughput"} <= set(
        bash_complete("atlas bench ", atlas_on_path)
    )
    flags = bash_complete("atlas bench smollm2-135m -", atlas_on_path)
    assert {"-p", "--n-gen", "--threads"} <= set(flags)
    assert bash_complete("atlas bench smollm2-135m --thr", atlas_on_path) == ["--threads"]
    env = dict(atlas_on_path, _ATLAS_COMPLETE="complete_zsh")
    env["_TYPER_COMPLETE_ARGS"] = "atlas bench smollm2-135m --thr"
    done = subprocess.run(["atlas"], capture_output=True, text=True, env=env)
    assert '"--threads":' in done.stdout


def test_fish_completes_commands(atlas_on_path):
    if shutil.which("fish") is None:
        pytest.skip("fish is not installed")
    program = f"source {SCRIPTS['fish']}; complete -C 'atlas ch'; complete -C 'atlas chat --thi'"
    done = subprocess.run(
        ["fish", "-c", program], capture_output=True, text=True, env=atlas_on_path
    )
    assert done.stdout.splitlines()[0].startswith("chat\t")
    assert "--think" in done.stdout


def test_zsh_protocol(atlas_on_path):
    # zsh needs a live line editor to run a completion widget; check what the hook evals
    env = dict(atlas_on_path, _TYPER_COMPLETE_ARGS="atlas ch", _ATLAS_COMPLETE="complete_zsh")
    done = subprocess.run(["atlas"], capture_output=True, text=True, env=env)
    assert done.stdout.startswith("_arguments") and '"chat":' in done.stdout


def test_model_name_sources_are_extensible(monkeypatch, tmp_path):
    monkeypatch.setenv("ATLAS_HOME", str(tmp_path))
    (tmp_path / "models" / "pulled-model").mkdir(parents=True)
    monkeypatch.setattr(
        completion, "NAME_SOURCES", [*completion.NAME_SOURCES, lambda: [("extra-one", "test")]]
    )
    names = completion.model_names()
    assert names["smollm2-135m"] == "default model"
    assert names["pulled-model"] == "installed" and names["extra-one"] == "test"
    assert completion.complete_models("pul") == [("pulled-model", "installed")]
    assert completion.complete_models("./") == []  # paths: the shell completes files


def test_recipes_are_names(monkeypatch, tmp_path):
    (tmp_path / "qwen.toml").write_text('name = "qwen3-27b"\ndescription = "Qwen3 27B"\n')
    (tmp_path / "llama3-8b.toml").write_text("[model]\nrepo = 'x'\n")
    (tmp_path / "broken.toml").write_text("name = ")
    (tmp_path / "README.md").write_text("not a recipe")
    monkeypatch.setattr(completion, "recipes_dir", lambda: tmp_path)
    names = completion.model_names()
    assert names["qwen3-27b"] == "Qwen3 27B" and names["llama3-8b"] == "recipe"
    assert "broken" not in names and "README" not in names


# -- the cached table: the fast path answers as the CLI does ---------------------------------

FAST_LINES = [
    "atlas ",
    "atlas ch",
    "atlas --",
    "atlas chat --",
    "atlas chat --tem",
    "atlas chat --think h",
    "atlas chat --temperature 0.5 --",
    "atlas run --device ",
    "atlas run -t 4 smol",
    "atlas run smollm2-135m hello -",
    "atlas run --json --j",
    "atlas show my",
    "atlas completion ",
    "atlas bench ",
    "atlas bench smollm2-135m --thr",
    "atlas bench agentic --tool-format ",
    "atlas bench smollm2-135m --baseline ",
]
SLOW_LINES = ["atlas run -- ", "atlas run --device=c", "atlas --version ", "atlas bogus "]
FISH_ACTIONS = {"bash": [None], "zsh": [None], "fish": ["get-args", "is-args"]}


def tab_env(shell: str, line: str, action: str | None) -> dict[str, str]:
    """The variables each completion script sets, for `line` with the cursor at its end."""
    env = {"_ATLAS_COMPLETE": f"complete_{shell}"}
    if shell == "bash":
        words = completion.split_words(line)
        env["COMP_WORDS"], env["COMP_CWORD"] = line, str(len(words) - (not line.endswith(" ")))
    else:
        env["_TYPER_COMPLETE_ARGS"] = line
    if action:
        env["_TYPER_COMPLETE_FISH_ACTION"] = action
    return env


def answer(program, env, monkeypatch, capsys) -> tuple[str, int]:
    """What `program` (a main function) prints and exits with for one Tab."""
    with monkeypatch.context() as m:
        for key in (*completion_cache.ENV_KEYS, "_TYPER_COMPLETE_FISH_ACTION"):
            m.delenv(key, raising=False)
        for key, value in env.items():
            m.setenv(key, value)
        m.setattr(sys, "argv", ["atlas"])
        capsys.readouterr()
        with pytest.raises(SystemExit) as done:
            program()
    return capsys.readouterr().out, done.value.code or 0


@pytest.fixture
def cached_home(monkeypatch, tmp_path):
    monkeypatch.setenv("ATLAS_HOME", str(tmp_path))
    (tmp_path / "models" / "my-local-model").mkdir(parents=True)
    return tmp_path


def test_the_first_tab_writes_the_table(cached_home, monkeypatch, capsys):
    assert completion_cache.load() is None
    env = tab_env("bash", "atlas ch", None)
    assert answer(cli.main, env, monkeypatch, capsys) == ("chat\n", 0)
    assert completion_cache.table_path().is_file() and completion_cache.load() is not None


@pytest.mark.parametrize("shell", completion.SHELLS)
def test_the_table_answers_as_the_cli(shell, cached_home, monkeypatch, capsys):
    for action in FISH_ACTIONS[shell]:
        for line in FAST_LINES + SLOW_LINES:
            env = tab_env(shell, line, action)
            slow = answer(cli.main, env, monkeypatch, capsys)  # writes the table first time
            with monkeypatch.context() as m:
                for key, value in env.items():
                    m.setenv(key, value)
                fast = completion_cache.complete_from_cache(env["_ATLAS_COMPLETE"])
            if line in SLOW_LINES:
                assert fast is None, line  # the table cannot tell: the CLI answers
                assert answer(entry.main, env, monkeypatch, capsys) == slow, line
            else:
                assert fast == slow, (shell, action, line)
    assert (
        "smollm2-135m"
        in answer(entry.main, tab_env(shell, "atlas run ", "get-args"), monkeypatch, capsys)[0]
    )


def test_installed_models_complete_live(cached_home, monkeypatch, capsys):
    env = tab_env("bash", "atlas run my", None)
    assert answer(cli.main, env, monkeypatch, capsys)[0] == "my-local-model\n"
    (cached_home / "models" / "my-new-model").mkdir()
    with monkeypatch.context() as m:
        for key, value in env.items():
            m.setenv(key, value)
        fast = completion_cache.complete_from_cache("complete_bash")
    assert fast == ("my-local-model\nmy-new-model\n", 0)


def test_a_stale_table_is_ignored(cached_home, monkeypatch, capsys):
    env = tab_env("zsh", "atlas ch", None)
    slow = answer(cli.main, env, monkeypatch, capsys)
    table = json.loads(completion_cache.table_path().read_text())
    assert completion_cache.load() == table
    stale = dict(table, stamp=dict(table["stamp"], version="0.0.1"))
    completion_cache.table_path().write_text(json.dumps(stale))
    assert completion_cache.load() is None
    with monkeypatch.context() as m:
        for key, value in env.items():
            m.setenv(key, value)
        assert completion_cache.complete_from_cache("complete_zsh") is None
    assert answer(entry.main, env, monkeypatch, capsys) == slow  # and the CLI rewrites it
    assert completion_cache.load() == table
    monkeypatch.setattr(completion_cache, "__version__", "99.0")  # an upgrade
    assert completion_cache.load() is None
    completion_cache.save(table, table["stamp"]["typer"])  # the new version's table
    assert [p.name for p in completion_cache.table_path().parent.iterdir()] == ["atlas-99.0.json"]


def test_the_fast_path_imports_no_typer(cached_home):
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('typer', 'click', 'rich')), file=sys.stderr))\n"
        "from atlas_cli.entry import main\nmain()\n"
    )
    env = dict(os.environ, **tab_env("bash", "atlas ch", None), ATLAS_HOME=str(cached_home))
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    again = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert first.stdout == again.stdout == "chat\n"
    assert "typer" in first.stderr and again.stderr.strip() == "[]"


def test_words_split_as_click_splits_them():
    from click.shell_completion import split_arg_string

    for line in ["atlas run 'smol", 'atlas "a b" c', "atlas x\\", "atlas  a\tb ", ""]:
        assert completion.split_words(line) == split_arg_string(line)


class Color(enum.Enum):
    red = "red"
    rose = "rose"
    blue = "blue"


Tag = Annotated[list[str], typer.Option("--tag", "-T", help="Repeatable.")]
Quiet = Annotated[bool, typer.Option("--quiet/--loud", help="Less output.")]


def mini_app() -> typer.Typer:
    """A small Typer app with value kinds atlas's own commands do not have (yet)."""
    mini = typer.Typer()

    @mini.command()
    def go(src: typer.FileText, dst: str, color: Color = Color.red, tag: Tag = (), q: Quiet = 0):
        """Go somewhere."""

    @mini.command(hidden=True)
    def secret():
        """Hidden."""

    @mini.command()
    def other():
        """Another one."""

    return mini


def test_the_table_replays_value_kinds_atlas_may_grow():
    """Files, enum choices, repeated options, two positionals, a hidden command: the table's
    resolution gives the items Typer's own completion gives."""
    from typer._completion_classes import BashComplete

    from atlas_cli import completion_table

    command = typer.main.get_command(mini_app())
    table = completion_table.build(command, "mini", {}, {})
    typer_side = BashComplete(command, {}, "mini", "_MINI_COMPLETE")
    lines = ["", "o", "s", "go ", "go notes", "go a.txt ", "go a.txt b ", "go a.txt b -"]
    lines += ["go --color ", "go --color r", "go --color blue --c", "go --tag x --", "go -T x -"]
    lines += ["go --quiet -", "go --loud --"]
    for line in lines:
        *args, incomplete = line.split(" ")
        want = [(i.value, i.help) for i in typer_side.get_completions(args, incomplete)]
        assert completion_cache.resolve(table["tree"], args, incomplete) == want, line
