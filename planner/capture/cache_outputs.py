"""A transformers `DynamicCache` in a model's output, kept by torch.export.

A training step of a causal LM with `use_cache=True` (the default of Llama, Mistral, Mixtral, BLOOM
configs) returns its key/value cache. torch.export flattens outputs with pytree and refuses a type it
does not know; transformers ships the flatten/unflatten for `DynamicCache` (its keys and values, layer
by layer) for its own export path. Registering it lets the whole model be captured: the graph returns
the cache's tensors and its output is rebuilt into a `DynamicCache` holding them, as eager returns.

The registration is process-wide and stays (the captured module rebuilds its output with it on every
call); it only teaches pytree a type it refused before. A cache of another kind (a static or sliding
cache with other layer types) still fails export, which then reports it.
"""

from __future__ import annotations

import sys

import torch

__all__ = ["register_cache_outputs"]


def register_cache_outputs(model: torch.nn.Module) -> bool:
    """Register `DynamicCache` as a pytree node when `model` comes from transformers; whether it is one now."""
    if "transformers" not in sys.modules or not type(model).__module__.startswith("transformers."):
        return False
    try:
        from transformers.cache_utils import DynamicCache
        from transformers.integrations.executorch import register_dynamic_cache_export_support
    except ImportError:  # another transformers: export reports the cache as before
        return False
    from torch.utils import _pytree as pytree

    if DynamicCache not in pytree.SUPPORTED_NODES:
        register_dynamic_cache_export_support()
        node = pytree.SUPPORTED_NODES.get(DynamicCache)
        if node is not None:
            pytree.SUPPORTED_NODES[DynamicCache] = node._replace(unflatten_fn=_sharing(node.unflatten_fn))
    return DynamicCache in pytree.SUPPORTED_NODES


def _sharing(unflatten):
    """transformers' unflatten rebuilds the cache with `update`, which concatenates each layer's keys and
    values onto an empty tensor: a copy of the whole cache (2 x layers x batch x heads x seq x head_dim
    elements) beside the graph's own, held for the step, which the profile of the graph never sees. This
    one hands the graph's tensors to the layers as they are (plain layers; a sliding layer keeps
    transformers' way)."""
    from torch.utils import _pytree as pytree
    from transformers.cache_utils import DynamicCache, DynamicLayer

    def share(values, context):
        names, layout = context
        if any(window is not None for window in layout):
            return unflatten(values, context)
        tables = pytree._dict_unflatten(values, names)
        cache = DynamicCache()
        for k, v in zip(tables["key_cache"], tables["value_cache"]):
            layer = DynamicLayer()
            layer.lazy_initialization(k, v)  # dtype and device; two empty tensors
            layer.keys, layer.values = k, v
            cache.layers.append(layer)
        cache.layers.extend(DynamicLayer() for _ in range(len(layout) - len(cache.layers)))
        return cache

    return share
