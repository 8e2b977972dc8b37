"""The nanobatch schedule of one partitioned-layer call with context *and* sequence parallelism (TP × CP + SP).

The layer's input and output are ``[s/(cp·tp), b, h]``: megatron's CP layout (each CP rank holds 2 of the 2·CP
chunks of every sequence, cp_attention.py), then split along the sequence over the TP group. Each TP block
gathers its input and reduce-scatters its output over the TP group as in schedule_sp.py; between the TP
all-gather (which gives the CP-local ``[s/cp, b, h]``) and the attention the K/V of the nanobatch are
all-gathered over the CP group as in schedule_cp.py. Units (names from ``kareus_megatron.vocab``; the
slots of each are ``config.cp_sp_engine_slots``, the planner's cut, search/partition.py split_segments):

forward (and recompute), each one nanobatch at a time (nanobatch 0, then 1):

- ``attn_norm``: input_norm; TP all-gather of its output, partition ``fwd_sp_attn_norm``;
- ``cp_kv``: waits it before qkv; qkv, rope; CP all-gather of K and V, partition ``fwd_cp_kv``;
- ``attn``: waits that before the attention op; attention, proj; TP reduce-scatter, ``fwd_sp_attn``;
- ``mlp_norm``, ``mlp``: as with SP alone (``fwd_sp_mlp_norm``, ``fwd_sp_mlp``); the last reduce-scatter is
  issued at once, each output bias-dropout-add waits its own.

Backward: the leading all-gather of each output gradient (exposed), then units ``mlp`` (``bwd_sp_mlp``),
``attn_norm`` (pre_mlp_norm; TP all-gather of d proj-output, ``bwd_sp_attn_norm``), ``cp_kv`` (proj,
attention; CP reduce-scatter of dK/dV, ``bwd_cp_kv``), ``attn`` (waits it before rope; rope, qkv; TP
reduce-scatter of d qkv-input, ``bwd_sp_attn``) and the tail (input_norm). Each unit's collective is issued
before the planned op of the next unit, or with 1 nanobatch at once. TP collectives run on the layer's TP
group, the K/V ones on the CP group.
"""

from __future__ import annotations

from kareus_megatron.runtime.overlap.config import cp_sp_engine_slots
from kareus_megatron.runtime.overlap.pieces import _NB, Grads, _Coll, _leaf
from kareus_megatron.runtime.overlap.schedule_cp import CPUnits
from kareus_megatron.runtime.overlap.schedule_sp import SPLayerRun


class CPSPLayerRun(CPUnits, SPLayerRun):
    """One call of a partitioned layer under context and sequence parallelism (see module docstring)."""

    engine_slots = staticmethod(cp_sp_engine_slots)
    fwd_units = ("attn_norm", "cp_kv", "attn", "mlp_norm", "mlp")
    bwd_units = ("mlp", "attn_norm", "cp_kv", "attn")

    @staticmethod
    def partition(prefix: str, seg: str) -> str:
        """vocab partition name of unit `seg` in phase `prefix` ("fwd"/"bwd")."""
        return f"{prefix}_cp_kv" if seg == "cp_kv" else f"{prefix}_sp_{seg}"

    def forward_unit(self, seg: str, st: _NB, nb: int) -> _Coll:
        """Forward unit `seg` of nanobatch `nb`; return its pending collective."""
        name = self.coll_name("fwd", seg, nb)
        if seg == "cp_kv":
            gathered = st.colls["fwd.attn_norm"]
            st.ln1_in = _leaf(gathered.buf, self.grad)  # filled once waited: the qkv hook waits
            self._need = gathered
            return self.kv_gather(st, nb, name)
        if seg == "attn":
            self.attend_proj(st)
            return self._scatter(name, nb, st.attn_partial)
        return super().forward_unit(seg, st, nb)

    def backward_unit(self, seg: str, grads: Grads, st: _NB, nb: int) -> _Coll:
        """Backward unit `seg` of nanobatch `nb`; return its pending collective."""
        name = self.coll_name("bwd", seg, nb)
        if seg == "cp_kv":
            gathered = st.colls["bwd.attn_norm"]
            self._need = gathered  # waited at proj, before its backward reads the buffer
            return self.kv_scatter(grads, st, nb, gathered.buf, name)
        if seg == "attn":
            return self._scatter(name, nb, self.qkv_backward(grads, st, nb))
        return super().backward_unit(seg, grads, st, nb)
