"""Transformer model shapes: presets in workload/models.toml, or a small YAML/JSON file.

Terms: *hidden size* h, *heads* (query heads), *query groups* (KV heads; = heads without GQA),
*head_dim* (per-head width, h / heads unless given), *ffn_hidden_size* (MLP width; for SwiGLU the width
of each of the gate and up projections). *bias_linear*: every linear layer has a bias (GPT-2/3, BLOOM);
*qkv_bias*: the QKV projection has one even without bias_linear (Qwen2), as megatron-core's
``add_qkv_bias`` (bias_linear implies it); *tied_embeddings*: the output layer reuses the input
embedding's weights. The op graph does not model bias adds (fused into the GEMM epilogue or the
activation kernel); the parameter count includes biases and counts tied embeddings once per stage.
"""

from __future__ import annotations

import functools
import json
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

from kareus_megatron.errors import ConfigError, UnknownPresetError
from kareus_megatron.files import read_input_text

ACTIVATIONS = ("swiglu", "gelu")
NORMS = ("rmsnorm", "layernorm")
POSITIONS = ("rope", "alibi", "learned")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """Shape of a Llama/GPT-style decoder-only transformer."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int
    activation: str = "swiglu"
    norm: str = "rmsnorm"
    position: str = "rope"
    qk_norm: bool = False
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    bias_linear: bool = False
    qkv_bias: bool = False  # implied by bias_linear
    tied_embeddings: bool = False

    @property
    def has_qkv_bias(self) -> bool:
        """True when the QKV projection has a bias (qkv_bias, or bias_linear)."""
        return self.bias_linear or self.qkv_bias

    @property
    def kv_channels(self) -> int:
        """Width of one attention head (elements)."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def layer_params(self) -> int:
        """Parameters of one transformer layer (QKV, proj, MLP and norms, with their biases)."""
        h, d = self.hidden_size, self.kv_channels
        qkv_out = d * (self.num_attention_heads + 2 * self.num_query_groups)
        fc1_out = self.ffn_hidden_size * (2 if self.activation == "swiglu" else 1)
        proj = self.num_attention_heads * d * h
        mlp = h * fc1_out + self.ffn_hidden_size * h
        norms = 2 * h * (2 if self.norm == "layernorm" else 1)  # LayerNorm: weight and bias
        biases = (qkv_out if self.has_qkv_bias else 0) + ((h + fc1_out + h) if self.bias_linear else 0)
        return h * qkv_out + proj + mlp + norms + biases

    @property
    def embedding_params(self) -> int:
        """Parameters of the input embedding (= of the untied output layer)."""
        return self.vocab_size * self.hidden_size


_INT_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size")
_KEYS = {f.name for f in fields(ModelSpec)}
MAX_SIZE = 2**24  # the largest layer count, width or vocabulary a model file may give (far above any model)


def model_from_dict(data: Mapping[str, Any], name: str = "custom") -> ModelSpec:
    """Validate a mapping of ModelSpec keys; ConfigError names the bad key or value."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"model {name!r} must be a mapping of keys to values, not {type(data).__name__}.")
    d = dict(data)
    for key in d:
        if key not in _KEYS:
            raise ConfigError(f"model {name!r}: unknown key {key!r}; allowed: {', '.join(sorted(_KEYS))}.")
    d.setdefault("name", name)
    if "num_query_groups" not in d and "num_attention_heads" in d:
        d["num_query_groups"] = d["num_attention_heads"]
    for key in _INT_KEYS:
        if key not in d:
            raise ConfigError(f"model {name!r}: missing key {key!r}; a model needs {', '.join(_INT_KEYS)}.")
    for key in (*_INT_KEYS, "head_dim"):
        if key not in d:
            continue
        v = d[key]
        lo = 0 if key == "head_dim" else 1
        if isinstance(v, bool) or not isinstance(v, int) or v < lo or v > MAX_SIZE:
            raise ConfigError(f"model {name!r}: {key} = {v!r} must be an integer from {lo} to {MAX_SIZE}.")
    for key, allowed in (("activation", ACTIVATIONS), ("norm", NORMS), ("position", POSITIONS)):
        if key in d and d[key] not in allowed:
            raise ConfigError(f"model {name!r}: {key} = {d[key]!r}; allowed: {', '.join(allowed)}.")
    for key in ("qk_norm", "bias_linear", "qkv_bias", "tied_embeddings"):
        if key in d and not isinstance(d[key], bool):
            raise ConfigError(f"model {name!r}: {key} = {d[key]!r} must be true or false.")
    if not isinstance(d["name"], str) or not d["name"]:
        raise ConfigError(f"model {name!r}: name = {d['name']!r} must be a non-empty string.")
    if d["num_attention_heads"] % d["num_query_groups"]:
        raise ConfigError(
            f"model {name!r}: num_attention_heads {d['num_attention_heads']} is not a multiple of "
            f"num_query_groups {d['num_query_groups']}; use a divisor of the head count."
        )
    if not d.get("head_dim") and d["hidden_size"] % d["num_attention_heads"]:
        raise ConfigError(
            f"model {name!r}: hidden_size {d['hidden_size']} is not divisible by num_attention_heads "
            f"{d['num_attention_heads']}; give head_dim explicitly."
        )
    return ModelSpec(**d)


@functools.lru_cache(maxsize=1)
def _presets() -> dict[str, ModelSpec]:
    text = resources.files("kareus_megatron.workload").joinpath("models.toml").read_text(encoding="utf-8")
    return {name: model_from_dict(t, name) for name, t in tomllib.loads(text).items()}


def model_names() -> list[str]:
    """Names of the shipped model presets, sorted."""
    return sorted(_presets())


def model_spec(name_or_path: str) -> ModelSpec:
    """A preset by name, or a model read from a .yaml/.yml/.json file."""
    presets = _presets()
    if name_or_path in presets:
        return presets[name_or_path]
    path = Path(name_or_path)
    if path.suffix.lower() in (".yaml", ".yml", ".json"):
        if not path.is_file():
            raise ConfigError(f"model file {name_or_path!r} does not exist; give a preset or an existing file.")
        text = read_input_text(path, ConfigError, "model file", not_text_fix="give a YAML or JSON text file")
        try:
            if path.suffix.lower() == ".json":
                data = json.loads(text)
            else:
                import yaml

                data = yaml.safe_load(text)
        except (ValueError, ImportError) as e:  # json.JSONDecodeError and yaml.YAMLError derive from these
            raise ConfigError(f"model file {name_or_path!r} is not valid {path.suffix[1:]}: {e}".splitlines()[0]) from e
        except Exception as e:  # yaml.YAMLError does not derive from ValueError
            raise ConfigError(f"model file {name_or_path!r} is not valid YAML: {e}".splitlines()[0]) from e
        try:
            return model_from_dict(data, path.stem)
        except ConfigError as e:  # name the file, not only the model
            raise ConfigError(f"model file {name_or_path!r}: {e}") from None
    raise UnknownPresetError(
        f"unknown model {name_or_path!r}; known: {', '.join(sorted(presets))}, or a .yaml/.json file "
        "with the keys of workload/models.toml."
    )
