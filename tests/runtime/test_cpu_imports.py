"""runtime/frameworks/cpu_imports.py in a fresh interpreter each (import hooks act on first imports): on this
CPU-only torch, megatron-core loads without torch's compiler stack and with its fused functions eager, and the Triton
stand-in goes only to megatron's unguarded importers, after torch has probed for Triton and found none."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

IMPORT_MEGATRON = textwrap.dedent(
    """
    import json, sys
    from kareus_megatron.runtime.frameworks.cpu_imports import install_cpu_import_hooks
    install_cpu_import_hooks()
    import torch
    from megatron.core.models.gpt import GPTModel  # noqa: F401
    from megatron.core.pipeline_parallel import schedules  # noqa: F401
    from megatron.core.fusions.fused_bias_dropout import bias_dropout_add_fused_train
    import megatron.core.jit as jit, megatron.core.utils as utils
    x, bias, residual = torch.randn(4, 8), torch.randn(8), torch.randn(4, 8)
    out = bias_dropout_add_fused_train((x, bias), residual, 0.0)  # the fused function, eager: same numbers
    print(json.dumps({
        "compiler_stack": sorted(m for m in ("torch._dynamo", "torch._inductor.utils") if m in sys.modules),
        "jit_fuser": jit.jit_fuser.__name__,
        "have_triton": utils.HAVE_TRITON,
        "fused_equals_eager": bool(torch.equal(out, residual + (x + bias))),
    }))
    """
)

UNGUARDED_TRITON = textwrap.dedent(
    """
    import json, sys
    from kareus_megatron.runtime.frameworks.cpu_imports import install_cpu_import_hooks
    install_cpu_import_hooks()
    try:
        import triton  # noqa: F401  # this module is not one of megatron's unguarded importers
        before = "found"
    except ImportError:
        before = "none"
    # Megatron-LM's initialize.py imports this module, which imports triton at module level (no try)
    import megatron.core.transformer.custom_layers.batch_invariant_kernels  # noqa: F401
    import torch
    from torch.utils._triton import has_triton_package
    f = torch.compile(lambda t: t * 2 + 1, backend="eager")  # the compiler stack works beside the stand-in
    print(json.dumps({
        "before": before,
        "stand_in": type(sys.modules["triton"]).__name__,
        "torch_sees_triton": has_triton_package(),
        "compiled": f(torch.ones(2)).tolist(),
    }))
    """
)


def _run(code: str) -> dict:
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_megatron_core_loads_without_torchs_compiler_stack_and_its_fused_functions_run_eagerly():
    got = _run(IMPORT_MEGATRON)
    assert got["compiler_stack"] == [], got  # about 1.3 s of CPU per rank, for kernels a CPU never compiles
    assert got["jit_fuser"] == "noop_decorator"  # megatron's own disable_jit_fuser(), before its fusions are defined
    assert got["have_triton"] is False  # megatron-core 0.16's guarded import finds none, as without the hook
    assert got["fused_equals_eager"]


def test_the_triton_stand_in_goes_to_unguarded_importers_after_torch_probed_and_found_none():
    got = _run(UNGUARDED_TRITON)
    assert got["before"] == "none"  # any other importer: no Triton, as on this machine
    assert got["stand_in"] == "_InertModule"
    assert got["torch_sees_triton"] is False  # torch probed before the stand-in existed
    assert got["compiled"] == [3.0, 3.0]
