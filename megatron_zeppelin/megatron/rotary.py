"""Rotary frequencies for arbitrary token positions.

Megatron-Core's ``RotaryEmbedding`` builds angles for the contiguous range
``0..max_seq_len`` and moves them to CUDA.  A rank's buffer holds zigzag chunks
and pieces of many sequences, so every token needs the angle of *its own*
position in its own sequence.  This module computes exactly Megatron's angles
(same ``inv_freq``, interpolation and layout) for a tensor of positions; fed to
Megatron's unfused THD RoPE with ``freqs.size(0) == cu_seqlens[-1]``, they are
applied token by token ("exact mapping" in ``rope_utils._apply_rotary_pos_emb_thd``).
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding


def rotary_freqs(rope: RotaryEmbedding, position_ids: torch.Tensor) -> torch.Tensor:
    """Angles ``[t, 1, 1, rot_dim]`` for positions ``[t]``, as ``RotaryEmbedding.get_emb``
    lays them out for the range ``0..t``."""
    inv_freq = rope.inv_freq.to(position_ids.device)
    pos = position_ids.to(inv_freq.dtype)
    if rope.seq_len_interpolation_factor is not None:
        pos = pos / rope.seq_len_interpolation_factor
    freqs = torch.outer(pos, inv_freq)  # [t, rot_dim / 2]
    if rope.rotary_interleaved:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb[:, None, None, :]
