"""The decoder-with-past wrapper: flat past tensors in, flat present tensors out.

Both PyTorch exporters need plain tensors at the graph boundary, while transformers' models take and
return a ``Cache`` object. This module is the only place that knows how the pinned transformers version
(5.x: ``forward(cache=...)`` returning ``.cache``; 4.4x-4.5x: ``past_key_values=...``) plumbs it.

``traceable_rope`` makes LongRoPE's per-call table choice exportable (see there).

The cache is a ``DynamicCache`` built from the past tensors *without* the model config, so every layer is
a full ``DynamicLayer``: the present outputs are ``concat(past, new)`` for every layer, sliding-window
layers included (the window is applied by the attention mask, as in the original model; a
``DynamicSlidingWindowLayer`` would instead crop the present to the window, breaking the convention that
present = past + new).
"""

from __future__ import annotations

import contextlib
import inspect
import types

import torch


def _cache_kwarg(model) -> str:
    params = inspect.signature(model.forward).parameters
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    raise TypeError(f"{type(model).__name__}.forward takes neither `cache` nor `past_key_values`: "
                    "this transformers version is not supported by pagedkv's exporter")


def _layers_of(cache):
    """(keys, values) per layer of a returned cache object."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    if hasattr(cache, "key_cache"):  # transformers 4.4x DynamicCache
        return list(zip(cache.key_cache, cache.value_cache))
    return [(k, v) for k, v in cache]  # legacy tuple format


class DecoderWithPast(torch.nn.Module):
    """``forward(input_ids, attention_mask, position_ids, *past)`` -> ``(logits, *present)``.

    ``past`` is ``key_0, value_0, key_1, value_1, ...`` each ``[batch, kv_heads, past, head_dim]``; the
    returned presents follow the same order with ``past + seq`` positions.
    """

    def __init__(self, model, num_layers: int):
        super().__init__()
        self.model = model
        self.num_layers = int(num_layers)
        self._cache_kwarg = _cache_kwarg(model)

    def forward(self, input_ids, attention_mask, position_ids, *past):
        from transformers import DynamicCache

        if len(past) != 2 * self.num_layers:
            raise ValueError(f"past: expected {2 * self.num_layers} tensors (key and value per layer), "
                             f"got {len(past)}")
        cache = DynamicCache(ddp_cache_data=[(past[2 * i], past[2 * i + 1]) for i in range(self.num_layers)])
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, **{self._cache_kwarg: cache})
        returned = getattr(out, "cache", None)
        if returned is None:
            returned = out.past_key_values
        flat = []
        for key, value in _layers_of(returned):
            flat += [key, value]
        return (out.logits, *flat)


def _traceable_longrope_forward(self, x, position_ids):
    """transformers' ``longrope_frequency_update`` + the rotary forward, without the in-place buffer update.

    The update picks ``long_inv_freq`` when ``max(position_ids) + 1`` exceeds
    ``original_max_position_embeddings`` and ``original_inv_freq`` otherwise, then ``copy_``s it into the
    ``inv_freq`` buffer (``aten::copy``, which neither exporter converts). Here the same ``torch.where`` result
    is bound as the module's ``inv_freq`` for the duration of the undecorated forward (transformers' own,
    ``__wrapped__`` by ``dynamic_rope_update``), so the graph carries both tables and the switch.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    original = self.config.rope_parameters["original_max_position_embeddings"]
    long_inv_freq, _ = ROPE_INIT_FUNCTIONS[self.rope_type](self.config, x.device, seq_len=original + 1)
    seq_len = torch.max(position_ids) + 1
    inv_freq = torch.where(seq_len > original, long_inv_freq.to(x.device), self.original_inv_freq.to(x.device))
    buffer = self.inv_freq
    self.inv_freq = inv_freq
    try:
        return type(self).forward.__wrapped__(self, x, position_ids)
    finally:
        self.inv_freq = buffer


@contextlib.contextmanager
def traceable_rope(model):
    """While exporting: every LongRoPE rotary embedding of ``model`` (``rope_type == "longrope"``, one rope type
    for all layers) runs ``_traceable_longrope_forward``; on exit the modules are as they were."""
    patched = []
    for module in model.modules():
        forward = getattr(type(module), "forward", None)
        if getattr(module, "rope_type", None) == "longrope" and hasattr(forward, "__wrapped__"):
            module.forward = types.MethodType(_traceable_longrope_forward, module)
            patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward
