"""One declaration per architecture (backend/layers.py): only models/ and the loaders know
weight names and layer kinds, every backend reads what a model declares, and what a backend can
do is declared in the ops contract, not probed for."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from atlas_cli.backend.layers import (
    Attention,
    CacheLayout,
    Declaration,
    GatedDeltaNet,
    LayerKind,
)
from atlas_cli.backend.models.llama import LlamaModel
from atlas_cli.backend.models.llama import ModelArgs as LlamaArgs
from atlas_cli.backend.models.qwen3 import Qwen3Model
from atlas_cli.backend.models.qwen3_5 import ModelArgs as Qwen35Args
from atlas_cli.backend.models.qwen3_5 import Qwen3_5Model
from atlas_cli.backend.ops import numpy_ref
from atlas_cli.backend.ops.contract import FusedStep, Ops
from atlas_cli.backend.ops.cpu import fast as cpu_fast
from atlas_cli.backend.ops.cpu.fused import FusedDecoder, FusedLayers
from atlas_cli.backend.ops.native.decoder import DeviceDecoder
from atlas_cli.backend.ops.native.device import NativeOps

PACKAGE = Path(__file__).resolve().parent.parent / "atlas_cli"
# where weight names and layer kinds may be spelled out: the model files, the loaders (file
# names onto Hugging Face's), and the enum's own definition
NAMING = ("backend/models/", "backend/loaders/", "backend/layers.py")
FORBIDDEN = {
    "a weight name built from a layer prefix": re.compile(r"""["']model\.layers\."""),
    "a layer kind as a string": re.compile(r"""["'](full|linear)_attention["']"""),
}


def sources_outside_the_models() -> list[Path]:
    return [
        p
        for p in sorted(PACKAGE.rglob("*.py"))
        if not any(str(p.relative_to(PACKAGE)).startswith(n) for n in NAMING)
    ]


def probes_for_layer_types(tree: ast.AST) -> bool:
    """`hasattr(x, "layer_types")` or `getattr(x, "layer_types", ...)` anywhere in `tree`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("hasattr", "getattr"):
            args = node.args
            if len(args) >= 2 and getattr(args[1], "value", None) == "layer_types":
                return True
    return False


def test_only_models_and_loaders_name_weights_and_layer_kinds():
    found = []
    for path in sources_outside_the_models():
        text = path.read_text(encoding="utf-8")
        for what, pattern in FORBIDDEN.items():
            found += [f"{path.relative_to(PACKAGE)}: {what}" for _ in pattern.finditer(text)]
        if probes_for_layer_types(ast.parse(text)):
            found.append(f"{path.relative_to(PACKAGE)}: probes a config for layer_types")
    assert found == []


def test_the_checks_find_what_they_look_for():
    source = 'hasattr(model.args, "layer_types")\nw["model.layers.0.mlp"]\nk == "full_attention"'
    assert probes_for_layer_types(ast.parse(source))
    assert all(p.search(source) for p in FORBIDDEN.values())
    assert not probes_for_layer_types(ast.parse('getattr(a, "layers", None)'))


# -- the declarations ------------------------------------------------------------------------

LLAMA = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=100,
)
QWEN35 = LLAMA | dict(
    num_hidden_layers=4,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
)


def declarations():
    llama = LlamaArgs.from_config(LLAMA)
    return {
        "llama": (LlamaModel, llama),
        "qwen3": (Qwen3Model, llama),
        "qwen3_5": (Qwen3_5Model, Qwen35Args.from_config(QWEN35)),
    }


def declared_names(d: Declaration) -> set[str]:
    """Every weight name a declaration reads (the optional biases included)."""
    out = {d.embedding, d.final_norm, d.lm_head}
    for layer in d.layers:
        m = layer.mixer
        out |= {layer.input_norm, layer.post_norm, *layer.mlp, *m.inputs, m.output}
        if isinstance(m, Attention):
            out |= {*m.biases} | {n for n in (m.q_norm, m.k_norm) if n is not None}
        else:
            out |= {m.conv, m.decay, m.dt_bias, m.norm}
    return out


@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen3_5"])
def test_a_declaration_names_only_weights_the_model_checks(name):
    """The declaration and the model's shape table name the same weights: every name declared
    is checked at load, every required weight is read through the declaration (the decay rate
    A is formed by the model's sanitize from A_log)."""
    cls, args = declarations()[name]
    d = cls.declare(args)
    required, optional = cls.weight_shapes(args, set())
    decays = {lay.mixer.decay for lay in d.layers if lay.kind is LayerKind.GATED_DELTANET}
    names = declared_names(d)
    assert names - decays <= set(required) | set(optional)
    assert {n for n in required if not n.endswith(".A_log")} <= names


def test_qwen35_declares_its_hybrid_layers_and_their_cache():
    cls, args = declarations()["qwen3_5"]
    d = cls.declare(args)
    assert d.kinds == (LayerKind.GATED_DELTANET,) * 3 + (LayerKind.ATTENTION,)
    assert d.unit_offset_norms and isinstance(d.layers[0].mixer, GatedDeltaNet)
    att = d.layers[3].mixer
    assert isinstance(att, Attention) and att.output_gate and att.q_norm is not None
    assert d.cache_layout() == CacheLayout(d.kinds, 2, 16, (3, 2 * 2 * 8 + 4 * 8), (4, 8, 8))
    assert d.cache_layout().hybrid


def test_llama_and_qwen3_differ_only_in_their_qk_norms():
    decl = {n: cls.declare(a) for n, (cls, a) in declarations().items() if n != "qwen3_5"}
    llama, qwen3 = decl["llama"].layers[0].mixer, decl["qwen3"].layers[0].mixer
    assert llama.q_norm is None and qwen3.q_norm is not None
    assert (llama.inputs, llama.output, llama.biases) == (qwen3.inputs, qwen3.output, qwen3.biases)
    assert not decl["llama"].cache_layout().hybrid
    assert decl["llama"].norm_multiplier([1.0]).tolist() == [1.0]


# -- capabilities, declared ------------------------------------------------------------------

CAPABILITIES = {n: t for n, t in Ops.__annotations__.items() if n.isupper() and n != "NAME"}


@pytest.mark.parametrize("backend", [numpy_ref, cpu_fast, NativeOps], ids=lambda b: b.__name__)
def test_every_backend_declares_what_it_can_do(backend):
    assert set(CAPABILITIES) == {"KEEP_QUANTIZED", "PREFILL_CHUNK", "DEVICE_SAMPLING", "KV_TYPES"}
    for name in CAPABILITIES:
        assert hasattr(backend, name), f"{backend.__name__} does not declare {name}"
    assert isinstance(backend.KV_TYPES, tuple) and backend.KV_TYPES
    assert backend.PREFILL_CHUNK is None or backend.PREFILL_CHUNK > 0


@pytest.mark.parametrize("step", [FusedDecoder, FusedLayers, DeviceDecoder])
def test_every_fused_step_has_the_contracts_methods(step):
    methods = [n for n, v in vars(FusedStep).items() if callable(v) and not n.startswith("_")]
    assert set(methods) == {"decode", "logits_for", "new_cache", "use_kv_type"}
    assert all(callable(getattr(step, n, None)) for n in methods)
    assert isinstance(step.TOKEN_ON_DEVICE, bool)
