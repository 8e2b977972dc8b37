"""Context-parallel (CP) core attention on SDPA, for megatron-core's load-balanced CP sequence layout.

Layout (megatron-core ``get_batch_on_this_cp_rank``, ``megatron/core/utils.py`` of the installed 0.16.1
wheel): every sequence of length ``s`` is cut into ``2·cp`` chunks of ``c = s / (2·cp)`` tokens; CP rank
``r`` holds chunk ``r`` then chunk ``2·cp − 1 − r`` (``sq = 2·c`` local tokens), so causal work is
balanced. GPTModel's rotary embedding takes the positions of those chunks by itself
(``get_pos_emb_on_this_cp_rank``), and the batch's ``attention_mask`` is cut along its query dimension only
(``[b, 1, sq, s]``, keys in sequence order).

The partitioned layer (``schedule_cp.CPLayerRun``) all-gathers K and V over the CP group along dim 0, so
the core attention gets the local queries and every rank's keys in *rank order* (rank ``j``'s two chunks,
``j`` and ``2·cp − 1 − j``, at rows ``2·j·c .. 2·(j+1)·c``). ``cp_attend`` puts the keys in sequence order
and lets each local query chunk (global chunk ``g``) attend to its true causal past: with no mask, to the
keys of chunks ``0..g`` under a lower-right causal bias (``torch.nn.attention.bias.causal_lower_right``,
which keeps SDPA's flash kernels). Megatron's CP-sliced mask, when given, is checked for its dtype and shape
only and not read (the causal mask type's contract, as without CP: attention.py). Autograd gives dK/dV for
the gathered keys, which the layer reduce-scatters back to their owners. On the TP axis nothing changes
(heads are split as without CP).

No host sync per call: the reordering index is made on the device from ``arange`` (no host data to copy)
once per (cp, device) and cached.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.nn.attention.bias import causal_lower_right

from kareus_megatron.errors import InfeasibleConfigError


def sequence_order(cp: int) -> list[int]:
    """Gathered chunk slot (rank-order layout: rank j's chunks at slots 2j, 2j+1) of each sequence chunk."""
    return [2 * g if g < cp else 2 * (2 * cp - 1 - g) + 1 for g in range(2 * cp)]


def local_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two sequence chunks CP rank `rank` holds, in its local order."""
    return rank, 2 * cp - 1 - rank


def to_sequence_order(t: torch.Tensor, cp: int, dim: int) -> torch.Tensor:
    """Reorder gathered (rank-order) rows of `t` along `dim` into sequence order (differentiable)."""
    n = t.shape[dim]
    if n % (2 * cp):
        raise InfeasibleConfigError(f"gathered length {n} is not divisible by 2*cp={2 * cp}")
    shape = (*t.shape[:dim], 2 * cp, n // (2 * cp), *t.shape[dim + 1 :])
    return t.reshape(shape).index_select(dim, sequence_index(cp, t.device)).reshape(t.shape)


@functools.lru_cache(maxsize=8)
def sequence_index(cp: int, device: torch.device) -> torch.Tensor:
    """``sequence_order(cp)`` as an int64 tensor on `device`, computed there (no copy from the host), cached."""
    g = torch.arange(2 * cp, device=device)
    return torch.where(g < cp, 2 * g, 4 * cp - 1 - 2 * g)  # g >= cp: slot 2*(2cp-1-g)+1


Attend = Callable[..., torch.Tensor]  # (q, k, v, mask, is_causal, dropout_p) -> [b, np, sq, hv]


def cp_attend(
    attend: Attend,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    cp: int,
    rank: int,
    dropout_p: float,
) -> torch.Tensor:
    """Causal attention of local queries over gathered keys; returns [b, np, sq, hv].

    ``q`` [b, np, sq, hn] holds this rank's two chunks; ``k``/``v`` [b, ng, cp·sq, hn] every rank's, in rank
    order. ``mask``: None or megatron's causal boolean mask [.., sq, cp·sq] (checked, not read: the
    attention is causal either way). ``attend(q, k, v, mask, is_causal, dropout_p)`` is SDPAttention._attend.
    """
    sq, sk = q.shape[2], k.shape[2]
    if sq % 2 or sk != cp * sq:
        raise InfeasibleConfigError(
            f"context-parallel attention needs the local queries (2 chunks, got {sq} rows) and the K/V of all "
            f"{cp} CP ranks ({cp * sq} rows, got {sk}); SDPAttention runs CP only inside the partitioned layer"
        )
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape[-2:]) != (sq, sk)):
        raise InfeasibleConfigError(
            f"context-parallel attention needs a boolean attention_mask [.., {sq}, {sk}] (megatron's CP "
            f"batch layout) or None, got {tuple(mask.shape)} {mask.dtype}"
        )
    c = sq // 2
    k_seq, v_seq = to_sequence_order(k, cp, 2), to_sequence_order(v, cp, 2)
    outs = []
    for i, g in enumerate(local_chunks(cp, rank)):
        end = (g + 1) * c
        outs.append(
            attend(
                q[:, :, i * c : (i + 1) * c],
                k_seq[:, :, :end],
                v_seq[:, :, :end],
                causal_lower_right(c, end),
                False,
                dropout_p,
            )
        )
    return torch.cat(outs, dim=2)
