"""Model presets and files (workload/models.py) and the parallel layout (workload/parallel.py)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kareus_megatron.errors import ConfigError, InfeasibleConfigError, KareusError, UnknownPresetError
from kareus_megatron.workload.models import ModelSpec, model_from_dict, model_names, model_spec
from kareus_megatron.workload.parallel import make_parallel

# layers, hidden, heads, KV heads, FFN, vocab (docs/sources.md#model-shapes)
SHAPES = {
    "llama3.2-3b": (28, 3072, 24, 8, 8192, 128256),
    "qwen3-1.7b": (28, 2048, 16, 8, 6144, 151936),
    "llama3.3-70b": (80, 8192, 64, 8, 28672, 128256),
    "gpt3-175b": (96, 12288, 96, 96, 49152, 50257),
    "bloom-176b": (70, 14336, 112, 112, 57344, 250880),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_model_presets_match_the_published_shapes(name):
    m = model_spec(name)
    assert (
        m.num_layers,
        m.hidden_size,
        m.num_attention_heads,
        m.num_query_groups,
        m.ffn_hidden_size,
        m.vocab_size,
    ) == SHAPES[name]
    assert set(SHAPES) <= set(model_names())


def test_model_flavours():
    assert model_spec("qwen3-1.7b").qk_norm and model_spec("qwen3-1.7b").kv_channels == 128
    assert model_spec("bloom-176b").position == "alibi" and model_spec("gpt3-175b").activation == "gelu"
    assert model_spec("llama3.2-3b").norm == "rmsnorm"
    # a layer of Llama 3.2 3B: QKV 3072×(3072+2·1024), proj 3072², SwiGLU 3×3072×8192, two norms
    assert model_spec("llama3.2-3b").layer_params == 3072 * 5120 + 3072**2 + 3 * 3072 * 8192 + 2 * 3072


@pytest.mark.parametrize(
    "name, bias, tied",
    [
        ("llama3.2-3b", False, True),
        ("qwen3-1.7b", False, True),
        ("llama3.3-70b", False, False),
        ("gpt3-175b", True, True),
        ("bloom-176b", True, True),
    ],
)
def test_presets_record_biases_and_tied_embeddings(name, bias, tied):
    m = model_spec(name)
    assert (m.bias_linear, m.has_qkv_bias, m.tied_embeddings) == (bias, bias, tied)


def test_biases_layernorm_and_tied_embeddings_in_the_parameter_count():
    from kareus_megatron.workload.opgraph import stage_params

    base = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=256,
        vocab_size=100,
        activation="gelu",
        norm="layernorm",
    )
    plain = model_from_dict(base)
    # QKV 64x192, proj 64x64, MLP 2x64x256, two LayerNorms (weight and bias)
    assert plain.layer_params == 64 * 192 + 64 * 64 + 2 * 64 * 256 + 4 * 64
    biased = model_from_dict({**base, "bias_linear": True})
    assert biased.layer_params - plain.layer_params == 192 + 64 + 256 + 64  # QKV, proj, fc1, fc2 biases
    qkv_only = model_from_dict({**base, "qkv_bias": True})
    assert qkv_only.has_qkv_bias and not qkv_only.bias_linear and qkv_only.layer_params - plain.layer_params == 192
    tied = model_from_dict({**base, "tied_embeddings": True})
    one, two = make_parallel(plain, pp=1), make_parallel(plain, pp=2)
    assert stage_params(plain, one, 0) - stage_params(tied, one, 0) == 100 * 64  # PP=1: one shared matrix
    assert stage_params(plain, two, 1) == stage_params(tied, two, 1)  # PP>1: the last stage keeps a copy


def test_model_from_yaml_and_json(tmp_path):
    y = tmp_path / "tiny.yaml"
    y.write_text(
        "num_layers: 4\nhidden_size: 256\nnum_attention_heads: 8\nnum_query_groups: 2\n"
        "ffn_hidden_size: 1024\nvocab_size: 1000\nactivation: gelu\n"
    )
    m = model_spec(str(y))
    assert m.name == "tiny" and m.num_query_groups == 2 and m.activation == "gelu"
    j = tmp_path / "mha.json"
    j.write_text(
        json.dumps(
            {
                "name": "mha",
                "num_layers": 2,
                "hidden_size": 64,
                "num_attention_heads": 4,
                "ffn_hidden_size": 256,
                "vocab_size": 100,
            }
        )
    )
    assert model_spec(str(j)).num_query_groups == 4  # defaults to MHA


@pytest.mark.parametrize(
    "text, match",
    [
        ('{"num_layers": 2, "hidden": 64}', "unknown key 'hidden'"),
        (
            '{"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 8}',
            "missing key 'vocab_size'",
        ),
        (
            '{"num_layers": -1, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 8, "vocab_size": 9}',
            "num_layers",
        ),
        (
            '{"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 8, "vocab_size": 9, '
            '"activation": "relu"}',
            "activation",
        ),
        (
            '{"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 8, "vocab_size": 9, '
            '"tied_embeddings": "yes"}',
            "tied_embeddings = 'yes' must be true or false",
        ),
        ("[1, 2]", "mapping"),
        ("{not json", "not valid json"),
    ],
)
def test_bad_model_file_names_the_problem(tmp_path, text, match):
    p = tmp_path / "bad.json"
    p.write_text(text)
    with pytest.raises(ConfigError, match=match):
        model_spec(str(p))


def test_unknown_model():
    with pytest.raises(UnknownPresetError, match="llama3.2-3b"):
        model_spec("llama9")


_values = st.one_of(st.integers(-3, 200_000), st.text(max_size=8), st.booleans(), st.none(), st.floats(allow_nan=True))


@settings(max_examples=150, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(
            [
                "num_layers",
                "hidden_size",
                "num_attention_heads",
                "num_query_groups",
                "ffn_hidden_size",
                "vocab_size",
                "activation",
                "norm",
                "position",
                "qk_norm",
                "head_dim",
                "name",
                "bogus",
            ]
        ),
        _values,
        max_size=12,
    )
)
def test_model_parser_accepts_or_raises_config_error(data):
    try:
        m = model_from_dict(data)
    except ConfigError:
        return
    assert isinstance(m, ModelSpec) and m.num_attention_heads % m.num_query_groups == 0 and m.kv_channels > 0


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"tp": 5}, "--tp 5 does not divide"),
        ({"tp": 16}, "attention heads"),
        ({"pp": 30}, "fewer than 30 stages"),
        ({"pp": 3}, "--pp 3 does not split"),
        ({"tp": 8, "pp": 2, "nodes": 3, "gpus_per_node": 8}, "not a multiple"),
        ({"tp": 8, "pp": 2, "dp": 1, "nodes": 3, "gpus_per_node": 8}, "make the product match"),
        ({"cp": 2, "seq_length": 4098}, "2 × --cp 2"),
        ({"tp": 1, "sequence_parallel": True}, "needs --tp > 1"),
        ({"pp": 2, "vp": 4, "num_microbatches": 8}, "--vp 4"),
        ({"pp": 2, "vp": 2}, "--microbatches"),
        ({"pp": 2, "first_stage_layers": 10, "last_stage_layers": 10}, "add up to 28"),
        ({"recompute": "some"}, "--recompute"),
        ({"micro_batch_size": 0}, "--mbs"),
    ],
)
def test_infeasible_layouts_explain_the_fix(kw, match):
    with pytest.raises(KareusError, match=match):
        make_parallel(model_spec("llama3.2-3b"), **kw)


def test_explicit_first_and_last_stage_layers():
    par = make_parallel(model_spec("gpt3-175b"), tp=8, pp=8, first_stage_layers=11, last_stage_layers=13)
    assert par.layers_per_stage == (11, 12, 12, 12, 12, 12, 12, 13) and sum(par.layers_per_stage) == 96
    par = make_parallel(
        model_spec("llama3.2-3b"), pp=4, vp=2, num_microbatches=8, first_stage_layers=6, last_stage_layers=6
    )
    assert par.layers_per_stage == (6, 8, 8, 6) and par.chunk_layers(1, 1) == 4
    assert par.is_first_chunk(0, 0) and not par.is_first_chunk(0, 1) and par.is_last_chunk(3, 1)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tp=st.integers(1, 16),
    cp=st.integers(1, 4),
    pp=st.integers(1, 40),
    vp=st.integers(1, 3),
    dp=st.one_of(st.none(), st.integers(1, 4)),
    sp=st.booleans(),
    mbs=st.integers(1, 16),
    seq=st.integers(1, 9000),
    nodes=st.one_of(st.none(), st.integers(1, 8)),
    gpn=st.sampled_from([1, 2, 4, 8]),
    first=st.one_of(st.none(), st.integers(1, 20)),
    last=st.one_of(st.none(), st.integers(1, 20)),
    model=st.sampled_from(["llama3.2-3b", "qwen3-1.7b", "bloom-176b"]),
)
def test_parallel_config_is_valid_or_rejected(tp, cp, pp, vp, dp, sp, mbs, seq, nodes, gpn, first, last, model):
    m = model_spec(model)
    try:
        par = make_parallel(
            m,
            tp=tp,
            cp=cp,
            pp=pp,
            vp=vp,
            dp=dp,
            sequence_parallel=sp,
            micro_batch_size=mbs,
            seq_length=seq,
            num_microbatches=8,
            first_stage_layers=first,
            last_stage_layers=last,
            nodes=nodes,
            gpus_per_node=gpn,
        )
    except (InfeasibleConfigError, ConfigError):
        return
    assert sum(par.layers_per_stage) == m.num_layers and len(par.layers_per_stage) == pp
    assert all(k >= vp and k % vp == 0 for k in par.layers_per_stage)
    assert par.tp * par.cp * par.pp * par.dp == par.nodes * par.gpus_per_node
    assert m.num_attention_heads % tp == 0 and m.num_query_groups % tp == 0
    assert cp == 1 or seq % (2 * cp) == 0
