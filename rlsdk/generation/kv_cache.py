"""A key/value cache preallocated for a whole generation, filled from one prefill per distinct prompt.

transformers' ``DynamicCache`` grows each layer with ``torch.cat`` at every decode step: every step copies the
whole cache of every layer once more, so a generation of ``C`` tokens copies it ``C`` times. Here each layer's keys
and values live in one buffer sized for the prompt and every token the generation may add (``capacity``); a
decode step writes its one new column in place and attention reads a view of the filled part. Nothing is copied
per step.

The buffers start from a prefill of the *distinct* prompts only (a GRPO group repeats its prompt ``group_size``
times): each row's prompt keys and values are copied from its prompt's prefill once, when the buffers are made.

Shape names: ``B`` = rows (sequences), ``H`` = key/value heads, ``T`` = positions, ``D`` = head dim, ``U`` = distinct
prompts.
"""

from __future__ import annotations

from typing import Any

import torch


def _dynamic_layer_class() -> type:
    from transformers.cache_utils import DynamicLayer

    return DynamicLayer


def preallocate(cache: Any, rows_B: torch.Tensor | None, capacity: int) -> Any:
    """Turn ``cache`` (a ``DynamicCache`` after a prefill of the distinct prompts) into a cache of the call's rows
    with room for ``capacity`` positions per layer; returns it (changed in place).

    ``rows_B``: for each row, the index of its prompt among the prefilled ones (None: one row per prompt, in order).
    Layers of other kinds than transformers' plain ``DynamicLayer`` (sliding windows, linear attention) keep their
    own class and get their rows by ``batch_select_indices``.
    """
    dynamic = _dynamic_layer_class()
    for index, layer in enumerate(cache.layers):
        if type(layer) is dynamic and layer.is_initialized and layer.keys.numel() > 0:
            cache.layers[index] = PreallocatedLayer(layer.keys, layer.values, rows_B, capacity)
        elif rows_B is not None:
            layer.batch_select_indices(rows_B)
    return cache


class PreallocatedLayer(_dynamic_layer_class()):  # type: ignore[misc]
    """One layer's keys and values in buffers of ``capacity`` positions (``[B, H, capacity, D]``).

    ``keys`` and ``values`` are views of the filled positions, as transformers' layers expose them. A step that
    would pass ``capacity`` doubles the buffers (one copy) rather than fail: the sampler sizes them so that it
    does not happen.
    """

    def __init__(
        self, keys_U_H_T_D: torch.Tensor, values_U_H_T_D: torch.Tensor, rows_B: torch.Tensor | None, capacity: int
    ) -> None:
        super().__init__()
        length = keys_U_H_T_D.shape[-2]
        capacity = max(capacity, length)
        batch = keys_U_H_T_D.shape[0] if rows_B is None else rows_B.shape[0]
        self.dtype, self.device = keys_U_H_T_D.dtype, keys_U_H_T_D.device
        self._key_buffer = self._fill(keys_U_H_T_D, rows_B, batch, capacity)
        self._value_buffer = self._fill(values_U_H_T_D, rows_B, batch, capacity)
        self._length = length
        self.is_initialized = True
        self._refresh_views()

    @staticmethod
    def _fill(source_U_H_T_D: torch.Tensor, rows_B: torch.Tensor | None, batch: int, capacity: int) -> torch.Tensor:
        heads, length, dim = source_U_H_T_D.shape[1:]
        buffer_B_H_T_D = source_U_H_T_D.new_empty((batch, heads, capacity, dim))
        rows = source_U_H_T_D if rows_B is None else source_U_H_T_D.index_select(0, rows_B)
        buffer_B_H_T_D[:, :, :length].copy_(rows)
        return buffer_B_H_T_D

    def _refresh_views(self) -> None:
        self.keys = self._key_buffer[:, :, : self._length]
        self.values = self._value_buffer[:, :, : self._length]

    @property
    def capacity(self) -> int:
        """Positions each row has room for before the buffers must grow."""
        return self._key_buffer.shape[-2]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new positions in place; return views of every filled position (``[B, H, T, D]``)."""
        end = self._length + key_states.shape[-2]
        if end > self.capacity:
            self._grow(max(end, 2 * self.capacity))
        self._key_buffer[:, :, self._length : end].copy_(key_states)
        self._value_buffer[:, :, self._length : end].copy_(value_states)
        self._length = end
        self._refresh_views()
        return self.keys, self.values

    def _grow(self, capacity: int) -> None:
        for name in ("_key_buffer", "_value_buffer"):
            old = getattr(self, name)
            new = old.new_empty((*old.shape[:2], capacity, old.shape[-1]))
            new[:, :, : self._length].copy_(old[:, :, : self._length])
            setattr(self, name, new)

    def get_seq_length(self) -> int:
        return self._length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._length + query_length, 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows ``indices`` (finished rows leaving the batch): one copy of their filled positions."""
        for name in ("_key_buffer", "_value_buffer"):
            old = getattr(self, name)
            new = old.new_empty((indices.shape[0], *old.shape[1:]))
            new[:, :, : self._length].copy_(old[indices, :, : self._length])
            setattr(self, name, new)
        self._refresh_views()

    def batch_repeat_interleave(self, repeats: int) -> None:
        for name in ("_key_buffer", "_value_buffer"):
            setattr(self, name, getattr(self, name).repeat_interleave(repeats, dim=0))
        self._refresh_views()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` positions (a negative count, as transformers' layers take it), or
        keep the first ``tokens_to_remove`` when it is positive (the legacy form)."""
        keep = tokens_to_remove if tokens_to_remove > 0 else self._length + tokens_to_remove
        self._length = max(0, min(self._length, keep))
        self._refresh_views()

    def reset(self) -> None:
        self._length = 0
        self._refresh_views()
