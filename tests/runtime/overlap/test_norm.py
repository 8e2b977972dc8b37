"""runtime/overlap/norm.py: the SP-capable torch norm the kareus layer specs use where megatron's torch-norm
fallback (no Apex/TE) refuses sequence parallelism."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.torch_norm import WrappedTorchNorm  # noqa: E402

from kareus_megatron.errors import InfeasibleConfigError  # noqa: E402
from kareus_megatron.runtime.overlap.attention import get_sdpa_gpt_layer_spec  # noqa: E402
from kareus_megatron.runtime.overlap.layer import get_partitioned_gpt_layer_spec  # noqa: E402
from kareus_megatron.runtime.overlap.norm import SPTorchNorm, sp_capable_norms  # noqa: E402


def _cfg(**kw):
    base = dict(
        normalization="LayerNorm",
        sequence_parallel=False,
        layernorm_zero_centered_gamma=False,
        persist_layer_norm=False,
        memory_efficient_layer_norm=False,
    )
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_same_module_keys_and_numerics_as_megatrons_torch_norm(kind: str) -> None:
    ours = SPTorchNorm(config=_cfg(normalization=kind, sequence_parallel=True), hidden_size=8, eps=1e-6)
    theirs = WrappedTorchNorm(config=_cfg(normalization=kind), hidden_size=8, eps=1e-6)
    assert type(ours) is type(theirs)
    assert list(ours.state_dict()) == list(theirs.state_dict())  # checkpoints load either way
    with torch.no_grad():
        for p in ours.parameters():
            p.uniform_(0.5, 1.5)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(5, 3, 8)
    assert torch.equal(ours(x), theirs(x))
    assert all(p.sequence_parallel for p in ours.parameters())  # the TP grad all-reduce picks them up


def test_parameters_marked_only_with_sequence_parallelism() -> None:
    norm = SPTorchNorm(config=_cfg(), hidden_size=4)
    assert [p.sequence_parallel for p in norm.parameters()] == [False, False]


@pytest.mark.parametrize(
    ("kw", "word"),
    [({"layernorm_zero_centered_gamma": True}, "zero_centered_gamma"), ({"normalization": "L2Norm"}, "L2Norm")],
)
def test_refuses_what_torch_norms_cannot_do_in_one_line(kw: dict, word: str) -> None:
    with pytest.raises(InfeasibleConfigError, match=word) as e:
        SPTorchNorm(config=_cfg(**kw), hidden_size=4)
    assert "\n" not in str(e.value)


def _norms(spec) -> dict[str, object]:
    attn = spec.submodules.self_attention.submodules
    return {
        "input": spec.submodules.input_layernorm,
        "pre_mlp": spec.submodules.pre_mlp_layernorm,
        "q": attn.q_layernorm,
        "k": attn.k_layernorm,
    }


def test_kareus_specs_swap_only_megatrons_torch_norm() -> None:
    assert _norms(get_gpt_layer_local_spec())["input"] is WrappedTorchNorm  # this machine: no Apex, no TE
    for spec in (
        get_partitioned_gpt_layer_spec(),
        get_sdpa_gpt_layer_spec(),
        get_partitioned_gpt_layer_spec(normalization="RMSNorm"),
    ):
        n = _norms(spec)
        assert n["input"] is SPTorchNorm and n["pre_mlp"] is SPTorchNorm
        assert n["q"] is not SPTorchNorm  # IdentityOp without qk_layernorm: left alone
    n = _norms(get_sdpa_gpt_layer_spec(qk_layernorm=True))
    assert n["q"] is SPTorchNorm and n["k"] is SPTorchNorm
    spec = get_gpt_layer_local_spec()
    spec.submodules.input_layernorm = torch.nn.Identity  # not megatron's torch norm: kept
    assert sp_capable_norms(spec).submodules.input_layernorm is torch.nn.Identity
