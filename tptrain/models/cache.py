"""The KV cache of tptrain's decoder: every position's keys and values so far, per layer, so that a generation step
runs only its new tokens (transformers' DynamicCache plays this part for the transformers backend, and this class
answers the engine's one call, `get_seq_length`).

    out = model(prompt_ids, attention_mask=mask, use_cache=True)          # out.past_key_values: a KVCache
    out = model(next_ids, attention_mask=longer_mask, position_ids=pos, past_key_values=out.past_key_values)

Single-device code like the rest of the model: a layer appends what it computed for the new tokens, whatever its
shapes (a rank's own KV heads under tensor parallelism; multi-head latent attention's compressed latent and RoPE key),
and reads back every position so far. Each tensor lives in a buffer that doubles when full, so a step copies only its
new positions.
"""
from __future__ import annotations

import torch


class LayerCache:
    """One layer's cached tensors, each (..., positions, features): the positions so far are `[..., :length, :]`."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.length = 0

    def update(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Append each of `tensors`' positions (dim -2: the same count in each) after the ones held; returns every
        position so far of each (views of the buffers)."""
        new = tensors[0].shape[-2]
        end = self.length + new
        if not self.buffers:
            self.buffers = [t.new_empty((*t.shape[:-2], end, t.shape[-1])) for t in tensors]
        elif end > self.buffers[0].shape[-2]:  # full: twice the room, the held positions copied once
            room = max(end, 2 * self.buffers[0].shape[-2])
            grown = [b.new_empty((*b.shape[:-2], room, b.shape[-1])) for b in self.buffers]
            for old, buffer in zip(self.buffers, grown):
                buffer[..., :self.length, :] = old[..., :self.length, :]
            self.buffers = grown
        for buffer, t in zip(self.buffers, tensors):
            assert buffer.shape[:-2] == t.shape[:-2], f"a cached batch of {tuple(buffer.shape)} given {tuple(t.shape)}"
            buffer[..., self.length:end, :] = t
        self.length = end
        return tuple(buffer[..., :end, :] for buffer in self.buffers)


class KVCache:
    """Every decoder layer's LayerCache, by the layer's index in the whole model."""

    def __init__(self) -> None:
        self.layers: dict[int, LayerCache] = {}

    def layer(self, index: int) -> LayerCache:
        return self.layers.setdefault(index, LayerCache())

    def get_seq_length(self) -> int:
        """The positions held (0 before the first forward)."""
        return next(iter(self.layers.values())).length if self.layers else 0
