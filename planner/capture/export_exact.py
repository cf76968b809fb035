"""An exported transformers graph runs the attention kernels eager runs, so its gradients are eager's, bitwise.

Why they differed. Eager transformers reads the values of the padding mask to decide how to call
SDPA: when nothing is padded (and query length = key length for a causal mask), `masking_utils`
drops the mask (`_ignore_causal_mask_sdpa`, `_ignore_bidirectional_mask_sdpa`), and
`sdpa_attention_forward` then runs SDPA with `is_causal` and, for grouped-query attention
(Llama, Qwen2, Mistral, ... with fewer key/value heads than query heads), `enable_gqa=True` on the
key/value heads as they are. torch.export cannot read values, so those functions keep the mask, and
the exported graph builds the boolean mask and repeats the key/value heads (`repeat_kv`:
unsqueeze + expand + reshape) before SDPA. The forward agrees bitwise; the backward does not: the
expand's backward sums the repeated heads' key/value gradients after SDPA's backward, where the GQA
kernel accumulates them inside, in another order. On a tiny Llama the k_proj/v_proj gradients differ
by ~1e-8 and every gradient upstream follows (embeddings, earlier layers, RMSNorm weights).
Nothing else in the exported graphs of the test zoo differs from eager: each aten op runs the same
kernel and autograd formula as eager (linear, rms_norm's pow/mean/rsqrt chain, the rotary
embedding, SiLU, tied embeddings).

The fix. `match_eager_attention` rewrites each such SDPA node of a transformers attention module
into `eager_scaled_dot_product_attention(query, key, value, eager_attention_mask(mask))` on the
key/value heads before the repeat. At run time `eager_attention_mask` takes eager's decision on the
actual mask: None when it is exactly the causal mask (every key position present) or allows
everything, where eager's own skip was possible for that mask (recorded during export by
`recording_mask_skips`: the skip functions, and with no attention mask the packed-sequence check,
are only called where the model allows the skip). All of it is decided on the call's own lengths:
the capture keeps batch and sequence symbolic (shapes.py), so a shorter sequence may fall under a
sliding window that the example reached, where eager then drops the mask; the query/key lengths are
compared as symbolic expressions, never guarded. `eager_scaled_dot_product_attention` then calls transformers' own `use_gqa_in_sdpa` and
`repeat_kv`, like `sdpa_attention_forward`. A padded batch keeps its mask and repeated heads, as in eager.
Under torch.compile the mask is kept (the exported graph's own semantics: nothing data-dependent to
break the graph). On fake or meta tensors (planning without data) the mask is dropped wherever eager
could drop it: planned as for a batch without padding.

Relative position bias (T5, mT5, UMT5, LongT5, Switch, Pop2Piano, UDOP). `create_position_bias_mask`
folds the bias [1, H, Q, K] into SDPA's float mask. Where eager dropped the boolean mask it passes the
bias itself (a causal attention: `where` with a [1, 1, Q, K] causal mask); the exported graph keeps the
mask [B, 1, Q, K] and passes `where(mask, bias, min)` [B, H, Q, K]. The values agree, and in float32
so do the gradients; under bf16 autocast they do not: SDPA casts its mask to bf16, so eager sums the
bias's gradient over the batch before that cast's backward and the graph after it (the relative
attention bias weights then differ by ~1e-4). `match_eager_attention` rewrites such a `where` (and
the `contiguous` after it, where transformers makes one) into `eager_position_bias_mask`, which takes
eager's decision on the actual mask in the same way and then calls transformers' own
`create_position_bias_mask`, so that the mask has eager's layout as well as its values. The layout
matters on CUDA: SDPA's fused kernels need the mask's last stride to be 1, and the kernels draw their
dropout differently (a fused kernel from its own Philox offsets, the math path with the dropout op).
transformers 5.17 passes the bias as T5's permuted embedding view (last stride = heads, so the math
path), later versions a contiguous copy (a fused kernel); a graph whose mask is laid out otherwise than
eager's trains with other dropout masks on CUDA while the CPU, always on the math path in training,
stays bitwise.

One concept, so one module over 500 lines: an exported graph's attention made eager's; the mask decisions
and the graph rewrite that inserts them read the same transformers internals.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

__all__ = [
    "MaskSkip",
    "recording_mask_skips",
    "match_eager_attention",
    "eager_attention_mask",
    "eager_position_bias_mask",
    "eager_bias_plus_mask",
    "eager_scaled_dot_product_attention",
]

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_WHERE = (torch.ops.aten.where.self, torch.ops.aten.where.ScalarOther)
_CONTIGUOUS = torch.ops.aten.contiguous.default
# Where eager transformers reads mask values to drop the mask (all in transformers.masking_utils).
_SKIP_FUNCTIONS = {
    "causal": "_ignore_causal_mask_sdpa",
    "bidirectional": "_ignore_bidirectional_mask_sdpa",
    "packed": "find_packed_sequence_indices",
}


@dataclass(frozen=True)
class MaskSkip:
    """One call, during export, of a transformers function that lets eager drop the mask."""

    kind: str
    """'causal' or 'bidirectional'."""
    kv_length: int
    """Key length (tokens) the mask was built for."""
    local_attention_size: int | None
    """Sliding-window / chunk size (tokens); eager never drops a mask at or beyond it."""


@contextlib.contextmanager
def recording_mask_skips() -> Iterator[list[MaskSkip]]:
    """Within: every call of transformers' mask-skip functions is recorded in the yielded list.

    Nothing is patched when transformers' masking module is not loaded (a model that is not a
    transformers model never reaches it).
    """
    masking = sys.modules.get("transformers.masking_utils")
    calls: list[MaskSkip] = []
    originals = {kind: getattr(masking, name, None) for kind, name in _SKIP_FUNCTIONS.items()} if masking else {}
    for kind, original in originals.items():
        if original is not None:
            setattr(masking, _SKIP_FUNCTIONS[kind], _recorder(kind, original, calls))
    try:
        yield calls
    finally:
        for kind, original in originals.items():
            if original is not None:
                setattr(masking, _SKIP_FUNCTIONS[kind], original)


def _recorder(kind: str, original: Any, calls: list[MaskSkip]) -> Any:
    import inspect

    signature = inspect.signature(original)

    def record(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments
        with contextlib.suppress(AttributeError, TypeError, ValueError, RuntimeError):  # symbolic: not recorded
            if kind == "packed":  # no attention mask: eager skips the causal mask unless the positions restart
                calls.append(MaskSkip("causal", _hint(given["position_ids"].shape[-1]), None))
            else:
                local = given.get("local_attention_size")
                calls.append(MaskSkip(kind, _hint(given["kv_length"]), None if local is None else _hint(local)))
        return original(*args, **kwargs)

    return record


def _plain(t: Any) -> bool:
    """A tensor with values to read (not fake, functional or meta)."""
    return type(t) is torch.Tensor and t.device.type != "meta"


def eager_attention_mask(
    mask: torch.Tensor, *, causal: bool, bidirectional: bool, window: int | None = None
) -> torch.Tensor | None:
    """None where eager transformers drops this boolean mask [B, 1|H, Q, K]; else the mask.

    causal: the causal skip is possible here (eager drops the mask when it is exactly the causal
    mask, Q = K); bidirectional: eager drops a mask that allows every position; window: the
    attention's sliding window or chunk (tokens), at or beyond which eager keeps any mask. All
    decided on this call's lengths, not the captured example's (a dynamic-shape capture runs others).
    """
    if torch.compiler.is_compiling():
        return mask
    q, k = mask.shape[-2], mask.shape[-1]
    if window is not None and k >= window:
        return mask
    # The same temporaries with and without values, so a plan made on the meta device counts them.
    everything = mask.all() if bidirectional else None  # [] bool
    lower = torch.ones(q, k, dtype=torch.bool, device=mask.device).tril_() if causal and q == k else None  # [Q, K]
    if not _plain(mask):  # no values (meta, fake): as for a batch without padding, the usual training batch
        return None if everything is not None or lower is not None else mask
    if everything is not None and bool(everything):
        return None
    if lower is not None and torch.equal(mask, lower.expand_as(mask)):
        return None
    return mask


def eager_position_bias_mask(
    mask: torch.Tensor,
    position_bias: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    causal: bool,
    bidirectional: bool,
    window: int | None = None,
    is_causal: bool = False,
) -> torch.Tensor:
    """SDPA's float mask as eager makes it from the boolean `mask` [B, 1, Q, K] and `position_bias`
    [1|B, H, Q, K]: transformers' own `create_position_bias_mask` on the mask where eager keeps it, and on
    no mask where eager drops it (`eager_attention_mask`), which gives the bias itself or, for a causal
    attention (`is_causal`), the bias under a [1, 1, Q, K] causal mask, so that its gradient is summed over
    the batch where eager sums it.

    transformers' function is called, not copied, for the mask's layout as much as its values: CUDA's SDPA
    picks its kernel by the mask's strides (the fused kernels need the last one to be 1) and each kernel
    draws its dropout differently. Some transformers versions pass the bias view as it is (T5's permuted
    embedding, last stride = heads: the math kernel), later ones copy it contiguous (a fused kernel)."""
    from transformers.integrations import sdpa_attention

    kept = eager_attention_mask(mask, causal=causal, bidirectional=bidirectional, window=window)
    # as `sdpa_attention_forward`: causal only without a mask and for more than one query
    causal_kernel = kept is None and is_causal and query.shape[2] > 1
    return sdpa_attention.create_position_bias_mask(position_bias, kept, causal_kernel, query, key)


def _position_bias_where(mask: Any, sdpa: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(the `where(bool mask, bias, fill)` node that makes SDPA's float `mask`, its boolean mask, SDPA's mask
    node: that `where` or its `contiguous`) where nothing else reads them; else None."""
    node = mask
    if isinstance(node, fx.Node) and node.target is _CONTIGUOUS:
        if set(node.users) != {sdpa}:
            return None
        node = node.args[0]
    if not isinstance(node, fx.Node) or node.target not in _WHERE or len(node.args) != 3:
        return None
    cond, bias = node.args[0], node.args[1]
    if set(node.users) != {mask if mask is not node else sdpa}:
        return None
    if not isinstance(cond, fx.Node) or getattr(cond.meta.get("val"), "dtype", None) != torch.bool:
        return None
    value = bias.meta.get("val") if isinstance(bias, fx.Node) else None
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        return None
    return node, cond, mask


def eager_bias_plus_mask(
    position_bias: torch.Tensor, mask: torch.Tensor, *, causal: bool, bidirectional: bool, window: int | None = None
) -> torch.Tensor:
    """SDPA's float mask as a model that adds its relative position bias [1|B, H, Q, K] to transformers' boolean
    mask [B, 1, Q, K] (BEiT, Data2VecVision) makes it in eager: the bias alone where eager drops the mask
    (`eager_attention_mask`), else the sum. The exported graph keeps the all-True mask and adds it (True counts
    1.0): the softmax is the same in exact arithmetic but not in float32 (~1e-7), and the bias's gradient is
    summed over the batch in another order."""
    kept = eager_attention_mask(mask, causal=causal, bidirectional=bidirectional, window=window)
    return position_bias if kept is None else position_bias + kept


def _bias_plus_mask(mask: Any, sdpa: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(the float bias, the boolean mask) of an `add(bias, bool mask)` that only this SDPA reads; else None."""
    if not isinstance(mask, fx.Node) or mask.target is not torch.ops.aten.add.Tensor or len(mask.args) != 2:
        return None
    if set(mask.users) != {sdpa} or mask.kwargs.get("alpha", 1) != 1:
        return None
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else None for a in mask.args]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return None
    floats = [v.is_floating_point() for v in vals]
    bools = [v.dtype == torch.bool for v in vals]
    if floats == [True, False] and bools == [False, True]:
        return mask.args[0], mask.args[1]
    if floats == [False, True] and bools == [True, False]:
        return mask.args[1], mask.args[0]
    return None


def eager_scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    *,
    n_rep: int,
    dropout_p: float,
    scale: float | None,
    is_causal: bool,
) -> torch.Tensor:
    """SDPA as transformers' `sdpa_attention_forward` calls it; key/value [B, H/n_rep, K, D], output [B, H, Q, D]."""
    from transformers.integrations.sdpa_attention import repeat_kv, use_gqa_in_sdpa

    extra = {}
    if n_rep > 1:
        if use_gqa_in_sdpa(attn_mask, key, value):
            extra["enable_gqa"] = True
        else:
            key, value = repeat_kv(key, n_rep), repeat_kv(value, n_rep)
    causal = query.shape[2] > 1 and attn_mask is None and is_causal
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=causal, scale=scale, **extra
    )


def _dropped_mask_is_causal(module: torch.nn.Module, causal_ok: bool, bidirectional_ok: bool) -> bool:
    """Whether SDPA runs causal where eager dropped the mask. Eager passes `is_causal` from the call's keywords,
    else the module's attribute; the keywords are not in the graph (CLIP's text encoder passes True to
    attention modules whose attribute says False). A mask dropped by the causal rule was exactly the
    causal mask, so eager can only be right with a causal kernel there; where only the bidirectional rule
    applies, the mask allowed everything and the module's own flag holds."""
    if causal_ok and not bidirectional_ok:
        return True
    return bool(getattr(module, "is_causal", True))


def _unrepeat(node: Any, n_rep: int) -> tuple[fx.Node, list[fx.Node]] | None:
    """The key/value heads before `repeat_kv` (unsqueeze(2) -> expand -> reshape), and the chain's nodes.

    Under dynamic shapes `hidden_states[:, :, None, :, :]` also leaves whole-dimension slices around
    the unsqueeze (torch cannot drop a slice of a symbolic size without a guard); they are skipped.
    """
    if n_rep == 1:
        return node, []
    chain: list[fx.Node] = []
    for op in (torch.ops.aten.reshape.default, torch.ops.aten.expand.default):
        if not isinstance(node, fx.Node) or node.target is not op:
            return None
        chain.append(node)
        node = node.args[0]
    expand = chain[1]
    node = _skip_whole_slices(node, chain)
    if not isinstance(node, fx.Node) or node.target is not torch.ops.aten.unsqueeze.default or node.args[1] != 2:
        return None
    chain.append(node)
    node = _skip_whole_slices(node.args[0], chain)
    if len(expand.args[1]) != 5 or expand.args[1][2] != n_rep or not isinstance(node, fx.Node):
        return None
    return node, chain


def _skip_whole_slices(node: Any, chain: list[fx.Node]) -> Any:
    """The input below any slices that keep their whole dimension (start 0, end past it, step 1)."""
    while isinstance(node, fx.Node) and node.target is torch.ops.aten.slice.Tensor:
        defaults = [None, 0, None, None, 1]  # aten.slice.Tensor(self, dim=0, start=None, end=None, step=1)
        _, _, start, end, step = list(node.args) + defaults[len(node.args):]
        if start not in (0, None) or step != 1 or not (end is None or (isinstance(end, int) and end >= sys.maxsize)):
            break
        chain.append(node)
        node = node.args[0]
    return node


def _module_of(node: fx.Node, model: torch.nn.Module) -> torch.nn.Module | None:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    try:
        return model.get_submodule(path) if path else model
    except AttributeError:
        return None


def _arguments(node: fx.Node) -> dict[str, Any]:
    names = [a.name for a in _SDPA._schema.arguments]
    found = dict(zip(names, node.args))
    found.update(node.kwargs)
    for a in _SDPA._schema.arguments:
        if a.name not in found and a.has_default_value():
            found[a.name] = a.default_value
    return found


def match_eager_attention(gm: fx.GraphModule, model: torch.nn.Module, skips: list[MaskSkip]) -> int:
    """Rewrite the SDPA nodes of transformers attention whose mask eager may drop (and the `where` that folds
    a relative position bias into such a mask); return how many.

    `model` is the module that was exported (to find each node's attention module), `skips` the
    mask skips recorded while exporting it.
    """
    try:
        from transformers.integrations import sdpa_attention
        from transformers.integrations.sdpa_attention import repeat_kv, use_gqa_in_sdpa  # noqa: F401
    except ImportError:
        return 0
    folds_bias = hasattr(sdpa_attention, "create_position_bias_mask")  # what eager_position_bias_mask calls
    graph = gm.graph
    decided: dict[tuple[fx.Node, bool, bool], fx.Node] = {}
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _SDPA:
            continue
        a = _arguments(node)
        mask, query = a["attn_mask"], a["query"]
        module = _module_of(node, model)
        if (
            module is None
            or not type(module).__module__.startswith("transformers.")
            or not isinstance(mask, fx.Node)
            or a["is_causal"]
        ):
            continue
        bias = summed = None
        if getattr(mask.meta.get("val"), "dtype", None) != torch.bool:
            summed = _bias_plus_mask(mask, node)  # a float mask: a relative position bias added or folded
            bias = None if summed is not None else _position_bias_where(mask, node)
            if summed is None and (bias is None or not folds_bias) or a["enable_gqa"]:
                continue
            if int(getattr(module, "num_key_value_groups", 1) or 1) != 1:
                continue
        n_rep = 1 if a["enable_gqa"] else int(getattr(module, "num_key_value_groups", 1) or 1)
        keys, values = _unrepeat(a["key"], n_rep), _unrepeat(a["value"], n_rep)
        q_len, kv_len = _length(query), _length(a["key"])
        if keys is None or values is None or q_len is None or kv_len is None or _hint(q_len) <= 1:
            continue
        # The skip functions are called wherever the model allows a skip, also at or beyond the window
        # (where they decline): the window is checked on each call's own length (eager_attention_mask).
        matching = [s for s in skips if s.kv_length == _hint(kv_len)]
        possible = {s.kind for s in matching}
        window = _local_size(module)
        if window is None and matching and all(s.local_attention_size is not None for s in matching):
            window = min(s.local_attention_size for s in matching)  # every such mask was local: its size
        causal_ok, bidirectional_ok = "causal" in possible and _same_size(q_len, kv_len), "bidirectional" in possible
        if not (causal_ok or bidirectional_ok):
            continue
        if summed is not None:  # SDPA stays, on eager's mask: the bias alone where eager drops the boolean mask
            _fold_bias_plus_mask(graph, mask, summed, {"causal": causal_ok, "bidirectional": bidirectional_ok,
                                                       "window": window})
            rewritten += 1
            continue
        if bias is not None:  # SDPA stays: eager calls it with the bias as its mask, not causal, on the heads as they are
            where, condition, made = bias
            order = {n: i for i, n in enumerate(graph.nodes)}
            if any(not isinstance(n, fx.Node) or order[n] > order[where] for n in (query, a["key"])):
                continue
            with graph.inserting_before(where):
                new = graph.call_function(
                    eager_position_bias_mask,
                    (condition, where.args[1], query, a["key"]),
                    {
                        "causal": causal_ok,
                        "bidirectional": bidirectional_ok,
                        "window": window,
                        "is_causal": _dropped_mask_is_causal(module, causal_ok, bidirectional_ok),
                    },
                )
            new.meta.update({k: v for k, v in made.meta.items() if k in ("nn_module_stack", "stack_trace")})
            # The whole of eager's mask (a `contiguous` included, where this transformers makes one) is now
            # `create_position_bias_mask`'s own, with the layout eager gives it.
            made.replace_all_uses_with(new)
            graph.erase_node(made)
            if made is not where:
                graph.erase_node(where)
            rewritten += 1
            continue
        key = (mask, causal_ok, bidirectional_ok, window)
        if key not in decided:
            with graph.inserting_after(mask):
                d = graph.call_function(
                    eager_attention_mask,
                    (mask,),
                    {"causal": causal_ok, "bidirectional": bidirectional_ok, "window": window},
                )
            d.meta.update({k: v for k, v in mask.meta.items() if k in ("nn_module_stack", "stack_trace")})
            decided[key] = d
        with graph.inserting_before(node):
            new = graph.call_function(
                eager_scaled_dot_product_attention,
                (query, keys[0], values[0], decided[key]),
                {
                    "n_rep": n_rep,
                    "dropout_p": a["dropout_p"],
                    "scale": a["scale"],
                    "is_causal": _dropped_mask_is_causal(module, causal_ok, bidirectional_ok),
                },
            )
        new.meta.update({k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace", "val")})
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        for dead in keys[1] + values[1]:
            if not dead.users:
                graph.erase_node(dead)
        rewritten += 1
    if rewritten:
        graph.lint()
        gm.recompile()
    return rewritten


def _fold_bias_plus_mask(graph: fx.Graph, mask: fx.Node, summed: tuple, decide: dict[str, Any]) -> None:
    """Put `eager_bias_plus_mask` (the bias alone where eager drops the boolean mask) in place of `mask`."""
    with graph.inserting_before(mask):
        new = graph.call_function(eager_bias_plus_mask, summed, decide)
    new.meta.update({k: v for k, v in mask.meta.items() if k in ("nn_module_stack", "stack_trace")})
    mask.replace_all_uses_with(new)
    graph.erase_node(mask)


def _local_size(module: torch.nn.Module) -> int | None:
    """The attention's sliding window or chunk (tokens): the module's own, else its config's; None for full attention."""
    if "sliding_window" in vars(module):  # per layer (Qwen2, Gemma): None on full-attention layers
        window = module.sliding_window
    else:  # one for every layer (Mistral's sliding window, Llama4's chunks)
        config = getattr(module, "config", None)
        window = getattr(config, "sliding_window", None) or getattr(config, "attention_chunk_size", None)
    return window if isinstance(window, int) else None


def _length(node: Any) -> int | torch.SymInt | None:
    """Sequence length (dim -2) of a [B, H, T, D] node's example value (symbolic under dynamic shapes); None if unknown."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    try:
        size = val.shape[-2]
    except (AttributeError, IndexError, TypeError):
        return None
    return size if isinstance(size, (int, torch.SymInt)) else None


def _same_size(a: int | torch.SymInt, b: int | torch.SymInt) -> bool:
    """Equal for every shape the graph takes, decided without a guard: the same int, or the same
    symbolic expression (two sizes equal only at the example, such as two dynamic dimensions that
    happen to match, are not)."""
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        if not (isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt)):
            return False
        return bool(a.node.expr == b.node.expr)  # sympy structural equality: no guard
    return int(a) == int(b)


def _hint(n: Any) -> int:
    """An int, or a symbolic size's example value without adding a guard: `int()` on a dynamic
    dimension would pin the captured graph to the example's shape (shapes.py)."""
    if isinstance(n, torch.SymInt):
        from torch.fx.experimental import symbolic_shapes

        # optimization_hint is newer torch's name for hint_int
        hint = getattr(symbolic_shapes, "optimization_hint", None) or symbolic_shapes.hint_int
        return int(hint(n))
    return int(n)
