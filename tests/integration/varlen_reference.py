"""A per-sequence reference for the CUDA varlen attention call, runnable on the CPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inferd.models.attention.varlen import VarlenBatch


def reference_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vb: VarlenBatch, scale: float
) -> torch.Tensor:
    """varlen_attention written out one sequence at a time: SDPA with the causal mask aligned
    bottom-right (the last query sees every key), over the first seqused_k keys of a span."""
    out = torch.empty_like(q)
    cu_q, cu_k = vb.cu_q.tolist(), vb.cu_k.tolist()
    used = None if vb.seqused_k is None else vb.seqused_k.tolist()
    for i in range(len(cu_q) - 1):
        k_end = cu_k[i + 1] if used is None else cu_k[i] + used[i]
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], k_end)
        nq, nk = qs.stop - qs.start, ks.stop - ks.start
        keys, last = torch.arange(nk, device=q.device), torch.arange(nk - nq, nk, device=q.device)
        o = F.scaled_dot_product_attention(
            q[qs].transpose(0, 1),
            k[ks].transpose(0, 1),
            v[ks].transpose(0, 1),
            attn_mask=keys[None, :] <= last[:, None],
            scale=scale,
            enable_gqa=True,
        )
        out[qs] = o.transpose(0, 1)
    return out
