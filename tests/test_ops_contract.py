"""Every ops implementation has every op of the contract (backend/ops/contract.py) with the
same parameter names, kinds and defaults, so a model file runs unchanged on any of them."""

from __future__ import annotations

import inspect

import pytest

from atlas_cli.backend.ops import contract, numpy_ref
from atlas_cli.backend.ops.cpu import fast as cpu_fast
from atlas_cli.backend.ops.native.device import NativeOps

IMPLEMENTATIONS = {"numpy_ref": numpy_ref, "cpu_fast": cpu_fast, "NativeOps": NativeOps}


def _params(fn, bound: bool) -> list[tuple[str, inspect._ParameterKind, object]]:
    params = list(inspect.signature(fn).parameters.values())
    if bound:  # a method looked up on the class: drop `self`
        params = params[1:]
    return [(p.name, p.kind, p.default) for p in params]


def test_the_contract_lists_the_ops_the_models_call():
    assert {"linear", "attention", "causal_conv1d", "gated_delta_rule", "device_kv_cache"} <= set(
        contract.OP_NAMES
    )


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("op", contract.OP_NAMES)
def test_op_has_the_contract_signature(impl, op):
    target = IMPLEMENTATIONS[impl]
    assert hasattr(target, op), f"{impl} lacks {op}"
    want = _params(getattr(contract.Ops, op), bound=True)
    got = _params(getattr(target, op), bound=inspect.isclass(target))
    assert got == want, f"{impl}.{op}{got} != contract {want}"


def test_every_implementation_names_its_device():
    assert numpy_ref.NAME == "cpu-ref" and cpu_fast.NAME == "cpu"
    assert "NAME" in contract.Ops.__annotations__
