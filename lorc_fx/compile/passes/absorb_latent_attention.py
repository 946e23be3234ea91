"""Rewrite SDPA over reconstructed latents into attention over the latents themselves, and
decode SDPA over quantized cache sides into attention that reads their codes.

Patterns (as the latent cache traces)::

    k = lorc.reconstruct(c_k, P_k, h_kv)                         # keys cached after RoPE
    k = lorc.rotated_reconstruct(c_k, P_k, h_kv, cos, sin, style)  # keys cached before it
    v = lorc.reconstruct(c_v, P_v, h_kv)
    out = sdpa(q, repeat_kv?(k), repeat_kv?(v), mask, ...)

With post-RoPE keys the SDPA becomes ``latent_attention`` (the query goes through the
per-head blocks of ``P_k``, attention runs once over the shared latent, the output comes back
through ``P_v``; in decode graphs the query heads are read as rows of the latent's one head).
With pre-RoPE keys, in a graph of at most ``MAX_DECODE_QUERY`` query tokens
(decode steps, draft verification), it becomes ``rotary_latent_attention``: keys rebuilt
and scored against queries turned back by each key's angle, values absorbed. Both exact; neither builds a ``(b, h, n, d)`` repeat of the
heads. Prefill over pre-RoPE keys keeps SDPA over the rebuilt keys and values (the fused
attention, and scores never materialised), and the ops are lowered to maths.

A quantized cache side reaches the graph as its codes dequantized, then its full-precision
window: ``cat([lorc.dequantize(codes...), window], dim=-2)``, cut to the side's tokens by a
``narrow`` where the window has spare rows (``QuantizedLatentDynamicLayer``), or the
``lorc.dequantize`` node alone for a side with no window (a static cache's whole buffer),
cut to its first slots or gathered in token order (a static sliding layer's ring). It is the latent of a
reconstruct above, or, in a plain quantized plan, the keys or values themselves. In decode
graphs (the same condition) an SDPA with a quantized side becomes the matching function of
``compile.quantized_attention`` (``quantized_latent_attention``,
``quantized_rotary_latent_attention``, ``quantized_kv_attention``), which reads the codes
with the dequantization fused into its reductions; afterwards the graph holds no
``lorc.dequantize`` feeding that attention. Prefill keeps the forms above over the side
dequantized (the op lowered to its maths). Codes of a width or layout those functions do
not read (3 bits; keys per token) are left to that fallback too.

A side stored as product vector codes reaches the graph as ``lorc.vector_latents(payload,
tables, window, ...)`` (its codes decoded, then its window, its sink over its position). In
decode graphs it is read the same way: scores and value sums over the codes
(``lorc::vector_scores`` / ``vector_sums``: a table of the query's dot products with the
codewords, the weighted sum of each block of 8 slots decoded in L1), the latent never written
out; keys cached before RoPE are still rebuilt from their decoded latent, their values read
from the codes.

A decode SDPA with one side a latent reconstruction and the other kept as it came (``h_kv``
heads: Gemma 4's values behind ``v_norm``) becomes ``one_side_latent_attention``.

Manual attention (``matmul(q, k.transpose(2, 3))``, whatever the model does to the scores,
``matmul(p, v)``: softcaps, sink logits) has each product rewritten on its own: keys rebuilt
from a latent into ``latent_scores`` (before RoPE, in decode graphs: ``pre_rope_scores`` at
scale 1), values into ``latent_sums``; what lies between stays (docs/design.md, "Manual
attention"). In decode graphs a product over a side stored as codes (latent or raw keys and
values) reads the codes (``quantized_scores`` / ``quantized_sums`` and their latent forms). The same products with the heads merged into the batch (``bmm`` and
``baddbmm`` over ``(b·h, t, ·)``: BLOOM, XGLM, TrOCR) read the query or weights unflattened to
their heads and give the result merged back.

A prefill (more than ``cache.layers.PREFILL_TOKENS`` incoming tokens) attends its own tokens
as computed: its SDPA reads them concatenated after the earlier ones rebuilt (or alone), no
pattern above, so it stays SDPA over the full keys and values.
"""
from __future__ import annotations

import operator

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from lorc_fx.analysis.fx_ops import op_name
from lorc_fx.compile.latent_attention import (latent_attention, latent_scores, latent_sums,
                                              one_side_latent_attention, pre_rope_scores,
                                              rotary_latent_attention)
from lorc_fx.compile.quantized_attention import (FUSED_BITS, KEY_AXES, VALUE_AXES, VECTOR,
                                                 quantized_kv_attention, quantized_latent_attention,
                                                 quantized_latent_scores, quantized_latent_sums,
                                                 quantized_rotary_latent_attention,
                                                 quantized_scores, quantized_sums)
from lorc_fx.cache.latent_ops import DEQUANTIZE, RECONSTRUCT, ROTATED_RECONSTRUCT
from lorc_fx.cache.layers import PREFILL_TOKENS
from lorc_fx.cache.stores.vector_ops import VECTOR_LATENTS
from .graph_utils import SDPA_TARGETS, erase_if_unused, fake, replace_call, strip_repeat_kv

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
              "enable_gqa")
_RECONSTRUCT_ARGS = ("latent", "basis", "num_heads")
_ROTATED_ARGS = ("latent", "basis", "num_heads", "cos", "sin", "style", "pairs")
_VECTOR_ARGS = ("payload", "values", "window", "coded", "tokens", "sink", "sink_at", "means",
                "chunk", "ring_from", "ring_to")
_DEQUANTIZE_ARGS = ("payload", "scale", "zero", "bits", "group", "axis", "length", "width",
                    "dtype")
# query tokens up to which attention over pre-RoPE keys or quantized sides materialises its
# scores: the writes the latent cache reads back as stored (longer ones are prefills, which
# attend their own tokens as computed: no side of theirs is codes alone)
MAX_DECODE_QUERY = PREFILL_TOKENS


def _bound(node: fx.Node, names: tuple[str, ...]) -> dict:
    """A call's arguments by name, whether given by position or by keyword."""
    bound = dict(zip(names, node.args))
    bound.update(node.kwargs)
    return bound


def few_query_tokens(query: fx.Node, axis: int = 2) -> bool:
    """A static query length (``query``'s dimension ``axis``) of at most
    ``MAX_DECODE_QUERY``: decode steps, draft verification."""
    value = fake(query)
    t = None if value is None else value.shape[axis]
    return isinstance(t, int) and t <= MAX_DECODE_QUERY


def _is_decode(sdpa: dict) -> bool:
    """:func:`few_query_tokens`, no dropout, no causal flag."""
    return (few_query_tokens(sdpa["query"]) and not sdpa.get("dropout_p")
            and not sdpa.get("is_causal"))


def _side(node: fx.Node, axes: tuple[int, ...]):
    """``node`` as a side ``(codes, window, tokens[, order])`` for ``compile.quantized_attention``:
    ``cat([lorc.dequantize(...), window], dim=-2)``, maybe cut to its first ``tokens`` rows
    (``narrow``), or a bare ``lorc.dequantize`` give the op's arguments (in its order) as
    ``codes``; any other node is a side kept in the model's dtype, ``(None, node, None)``.
    ``lorc.vector_latents`` (product vector codes) gives ``(VECTOR, *its arguments)``.
    A bare ``lorc.dequantize`` cut to its first ``tokens`` slots (a static sliding layer's
    ring before the window fills) is those slots' codes: its ``length`` becomes ``tokens``.
    A bare ``lorc.dequantize`` gathered along the tokens (``index_select(2, order)``: the
    ring once the window is full, its tokens in order) is every slot's codes and ``order``,
    the slot each token sits at: ``(codes, None, None, order)``. ``None`` for codes those
    functions do not read (a width not in ``FUSED_BITS``, a layout not in ``axes``, a cut
    whose length is not static, vector codes cut or gathered, a window gathered with them)."""
    whole, tokens, order = node, None, None
    if _is_narrow_of_first_tokens(node):
        whole, tokens = node.args[0], node.args[3]
    elif (gathered := _gathered_slots(node)) is not None:
        whole, order = gathered
    codes, window = whole, None
    if whole.target is torch.cat:
        parts = whole.args[0]
        dim = whole.args[1] if len(whole.args) > 1 else whole.kwargs.get("dim", 0)
        if len(parts) == 2 and dim in (-2, 2) and getattr(parts[0], "target", None) is DEQUANTIZE:
            codes, window = parts
    if codes.target is VECTOR_LATENTS:
        return None if tokens is not None or order is not None else (
            VECTOR, *(_bound(codes, _VECTOR_ARGS).get(name) for name in _VECTOR_ARGS))
    if codes.target is not DEQUANTIZE:
        return None, node, None
    bound = _bound(codes, _DEQUANTIZE_ARGS)
    if bound["bits"] not in FUSED_BITS or bound["axis"] not in axes:
        return None
    if order is not None and window is not None:
        return None
    if window is None and tokens is not None:  # the first slots of a bare buffer
        if not isinstance(tokens, int) or not isinstance(bound["length"], int):
            return None
        bound["length"] = min(bound["length"], tokens)
    codes = tuple(bound[name] for name in _DEQUANTIZE_ARGS)
    if order is not None:  # every slot of a bare buffer, and where each token sits
        return codes, None, None, order
    return codes, window, tokens


def _is_narrow_of_first_tokens(node: fx.Node) -> bool:
    """``x.narrow(2, 0, tokens)`` of a ``(b, h, n, width)`` side (dim 2 or -2)."""
    is_narrow = (node.op == "call_method" and node.target == "narrow") or \
        (node.op == "call_function" and node.target is torch.narrow)
    return is_narrow and len(node.args) == 4 and node.args[1] in (2, -2) and node.args[2] == 0


def _gathered_slots(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(x, order)`` of ``x.index_select(2, order)`` (dim 2 or -2) of a ``(b, h, n, width)``
    side, else None."""
    if op_name(node) != "index_select":
        return None
    bound = _bound(node, ("input", "dim", "index"))
    return (bound["input"], bound["index"]) if bound.get("dim") in (2, -2) else None


def _reads_codes(k_side, v_side) -> bool:
    """Both sides readable by ``compile.quantized_attention`` (``_side`` not None) and at
    least one of them quantized."""
    return k_side is not None and v_side is not None and (k_side[0] is not None
                                                          or v_side[0] is not None)


def _quantized_call(sdpa: dict, k_src: fx.Node, v_src: fx.Node):
    """The attention over quantized sides replacing a decode ``sdpa`` as ``(function, args,
    kwargs)``, or None when neither side is quantized (or one is quantized in a way
    ``compile.quantized_attention`` does not read)."""
    mask = dict(attn_mask=sdpa.get("attn_mask"), scale=sdpa.get("scale"))
    if k_src.target in (RECONSTRUCT, ROTATED_RECONSTRUCT) and v_src.target is RECONSTRUCT:
        k = _bound(k_src, _ROTATED_ARGS if k_src.target is ROTATED_RECONSTRUCT else _RECONSTRUCT_ARGS)
        v = _bound(v_src, _RECONSTRUCT_ARGS)
        k_side, v_side = _side(k["latent"], KEY_AXES), _side(v["latent"], VALUE_AXES)
        if not _reads_codes(k_side, v_side):
            return None
        if k_src.target is RECONSTRUCT:
            return quantized_latent_attention, (
                sdpa["query"], k_side, v_side, k["basis"], v["basis"], k["num_heads"]), mask
        return quantized_rotary_latent_attention, (
            sdpa["query"], k_side, k["cos"], k["sin"], v_side, k["basis"], v["basis"],
            k["num_heads"], k["style"], k.get("pairs")), mask
    k_side, v_side = _side(k_src, KEY_AXES), _side(v_src, VALUE_AXES)
    if not _reads_codes(k_side, v_side):
        return None
    return quantized_kv_attention, (sdpa["query"], k_side, v_side), mask


def _absorbed_call(sdpa: dict, k_src: fx.Node, v_src: fx.Node):
    """The absorbed attention call replacing ``sdpa`` as ``(function, args, kwargs)``, or None
    when its keys and values are not latents (or quantized sides) it can read."""
    if _is_decode(sdpa):
        call = _quantized_call(sdpa, k_src, v_src)
        if call is not None:
            return call
    if v_src.target is not RECONSTRUCT:
        return None
    v = _bound(v_src, _RECONSTRUCT_ARGS)
    mask, scale = sdpa.get("attn_mask"), sdpa.get("scale")
    if k_src.target is RECONSTRUCT:
        k = _bound(k_src, _RECONSTRUCT_ARGS)
        return latent_attention, (
            sdpa["query"], k["latent"], v["latent"], k["basis"], v["basis"], k["num_heads"]), dict(
            attn_mask=mask, dropout_p=sdpa.get("dropout_p", 0.0),
            is_causal=sdpa.get("is_causal", False), scale=scale, heads_as_rows=_is_decode(sdpa))
    if k_src.target is ROTATED_RECONSTRUCT and _is_decode(sdpa):
        k = _bound(k_src, _ROTATED_ARGS)
        return rotary_latent_attention, (
            sdpa["query"], k["latent"], k["cos"], k["sin"], v["latent"], k["basis"], v["basis"],
            k["num_heads"], k["style"], k.get("pairs")), dict(attn_mask=mask, scale=scale)
    return None


def _side_as_latent(node: fx.Node):
    """A side for ``one_side_latent_attention``: ``(form, heads)``, heads None for a side
    kept as it comes."""
    if node.target is RECONSTRUCT:
        a = _bound(node, _RECONSTRUCT_ARGS)
        return ("latent", a["latent"], a["basis"]), a["num_heads"]
    if node.target is ROTATED_RECONSTRUCT:
        a = _bound(node, _ROTATED_ARGS)
        return ("rotated", *(a.get(n) for n in _ROTATED_ARGS if n != "num_heads")), a["num_heads"]
    return ("kept", node), None


def _one_side_call(sdpa: dict, k_src: fx.Node, v_src: fx.Node):
    """A decode SDPA with exactly one side a latent reconstruction (values only as
    ``lorc::reconstruct``), the other kept with as many heads, as ``(function, args,
    kwargs)``; None otherwise."""
    if not _is_decode(sdpa):
        return None
    (keys, k_heads), (values, v_heads) = _side_as_latent(k_src), _side_as_latent(v_src)
    if (k_heads is None) == (v_heads is None) or values[0] == "rotated":
        return None
    heads = k_heads or v_heads
    kept = fake(values[1] if v_heads is None else keys[1])
    if kept is None or kept.dim() != 4 or kept.shape[1] != heads:
        return None
    return one_side_latent_attention, (sdpa["query"], keys, values, heads), dict(
        attn_mask=sdpa.get("attn_mask"), scale=sdpa.get("scale"))


def _dims(node) -> int | None:
    """How many dimensions ``node``'s recorded value has (None without one)."""
    value = fake(node) if isinstance(node, fx.Node) else None
    return None if value is None else value.dim()


def _transposed_last(node, dims: int) -> fx.Node | None:
    """``x`` of ``x`` (``dims`` dimensions) with its last two swapped, else None."""
    if op_name(node) != "transpose" or sorted(node.args[1:3]) not in ([dims - 2, dims - 1],
                                                                      [-2, -1]):
        return None
    return node.args[0]


def _stored_product(left: fx.Node, keys: fx.Node | None, values, decode: bool):
    """``(function, args)`` of the form of ``left @ keysᵀ`` (``keys`` given) or ``left @
    values``, all ``(b, h, ·, ·)``, that reads what the cache stores: keys or values rebuilt
    from a latent read through it (absorbed), and in decode graphs, a latent or raw side
    stored as codes read from them (``compile.quantized_attention``); None otherwise. Keys
    cached before RoPE are scored from their latent in decode graphs only (as
    ``rotary_latent_attention``)."""
    if keys is not None:
        k_src = strip_repeat_kv(keys)
        if k_src.target is RECONSTRUCT:
            k = _bound(k_src, _RECONSTRUCT_ARGS)
            if side := _coded(k["latent"], KEY_AXES, decode):
                return quantized_latent_scores, (left, side, k["basis"], k["num_heads"])
            return latent_scores, (left, k["latent"], k["basis"], k["num_heads"])
        if k_src.target is ROTATED_RECONSTRUCT and decode:
            k = _bound(k_src, _ROTATED_ARGS)
            return pre_rope_scores, (left, k["latent"], k["cos"], k["sin"], k["basis"],
                                     k["num_heads"], k["style"], k.get("pairs"), 1.0)
        side = _coded(k_src, KEY_AXES, decode)
        return None if side is None else (quantized_scores, (left, side))
    v_src = strip_repeat_kv(values) if isinstance(values, fx.Node) else None
    if v_src is not None and v_src.target is RECONSTRUCT:
        v = _bound(v_src, _RECONSTRUCT_ARGS)
        if side := _coded(v["latent"], VALUE_AXES, decode):
            return quantized_latent_sums, (left, side, v["basis"], v["num_heads"])
        return latent_sums, (left, v["latent"], v["basis"], v["num_heads"])
    side = _coded(v_src, VALUE_AXES, decode) if v_src is not None else None
    return None if side is None else (quantized_sums, (left, side))


def _coded(node: fx.Node, axes: tuple[int, ...], decode: bool):
    """``node`` as a side of ``compile.quantized_attention`` where it is stored as codes that
    module reads (``_side``), in a decode graph; None otherwise."""
    side = _side(node, axes) if decode else None
    return side if side is not None and side[0] is not None else None


def _absorbed_product(node: fx.Node):
    """Manual attention's ``matmul(q, k.transpose(2, 3))`` or ``matmul(p, v)`` over keys or
    values the cache stores as latents or codes (:func:`_stored_product`), as ``(function,
    args, what it reads)`` of the form that reads them; None for any other product. Whatever manual attention does between
    the two products (scale, mask, softcap, sink logits, softmax) stays."""
    if op_name(node) != "matmul" or len(node.args) != 2 or node.kwargs \
            or not _dims(node) == _dims(node.args[0]) == 4:
        return None
    left, right = node.args
    keys = _transposed_last(right, 4)
    found = _stored_product(left, keys, None if keys is not None else right,
                            few_query_tokens(left))
    return None if found is None else (*found, right)


def _merged(node) -> tuple[fx.Node, int] | None:
    """``x`` and its head count ``h`` where ``node`` is ``x.reshape(b·h, n, d)`` (or a
    ``view``) of a ``(b, h, n, d)`` ``x``: keys or values with their heads merged into the
    batch for ``bmm`` (BLOOM, XGLM, TrOCR). Row ``i·h + j`` of ``node`` is head ``j`` of
    row ``i``, so ``unflatten(0, (-1, h))`` of the other operand gives back its heads."""
    if op_name(node) not in ("reshape", "view") or _dims(node.args[0]) != 4 or _dims(node) != 3:
        return None
    (b, h, n, d), merged = fake(node.args[0]).shape, fake(node).shape
    if not isinstance(h, int) or not statically_known_true(
            (merged[0] == b * h) & (merged[1] == n) & (merged[2] == d)):
        return None
    return node.args[0], h


def _merged_product(node: fx.Node):
    """Attention with heads merged into the batch (``(b·h, t, ·)``): ``bmm(q, k.transpose(1,
    2))``, ``baddbmm(bias, q, k.transpose(1, 2), beta=, alpha=)`` (BLOOM's ALiBi) or ``bmm(p,
    v)`` (a 3-d ``matmul`` too) over keys or values stored as latents or codes, as ``(function,
    args, heads, bias terms, what it reads)``: the absorbed product of :func:`_stored_product`
    over ``left`` unflattened to ``(b, h, t, ·)``, flattened back, then ``beta · bias +
    alpha · product``; None for any other call."""
    name = op_name(node)
    if name == "baddbmm":
        bound = _bound(node, ("input", "batch1", "batch2", "beta", "alpha"))
        left, right = bound.get("batch1"), bound.get("batch2")
        terms = (bound["input"], bound.get("beta", 1), bound.get("alpha", 1))
    elif name in ("bmm", "matmul") and len(node.args) == 2 and not node.kwargs:
        (left, right), terms = node.args, None
    else:
        return None
    if _dims(left) != 3 or _dims(node) != 3:
        return None
    keys = _transposed_last(right, 3)
    merged = _merged(keys if keys is not None else right)
    if merged is None:
        return None
    x, heads = merged
    found = _stored_product(left, *((x, None) if keys is not None else (None, x)),
                            few_query_tokens(left, axis=1))
    return None if found is None else (*found, heads, terms, right)


def _replace_merged(graph: fx.Graph, node: fx.Node, function, args, heads: int, terms) -> None:
    """``node`` replaced by ``function`` over ``args[0]`` unflattened to its heads, the result
    flattened back and, for ``baddbmm``, its ``beta · input + alpha ·`` terms added."""
    with graph.inserting_before(node):
        left = graph.call_method("unflatten", (args[0], 0, (-1, heads)))
        out = graph.call_method("flatten", (graph.call_function(function, (left, *args[1:])),
                                            0, 1))
        if terms is not None:
            bias, beta, alpha = terms
            if alpha != 1:
                out = graph.call_function(operator.mul, (out, alpha))
            if beta != 0:  # baddbmm ignores its input at beta 0
                bias = bias if beta == 1 else graph.call_function(operator.mul, (bias, beta))
                out = graph.call_function(operator.add, (bias, out))
    out.meta = dict(node.meta)
    node.replace_all_uses_with(out)
    graph.erase_node(node)


def absorb_latent_attention(gm: fx.GraphModule) -> int:
    """Rewrite every SDPA whose keys and values are latent reconstructions it can read, and
    manual attention's two products over such keys or values (``_absorbed_product``, or
    ``_merged_product`` with the heads merged into the batch); returns how many attention
    calls or products it rewrote."""
    graph, rewritten = gm.graph, 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in SDPA_TARGETS:
            continue
        a = _bound(node, _SDPA_ARGS)
        k_src, v_src = strip_repeat_kv(a["key"]), strip_repeat_kv(a["value"])
        call = _absorbed_call(a, k_src, v_src) or _one_side_call(a, k_src, v_src)
        if call is None:
            continue
        replace_call(graph, node, *call)
        erase_if_unused(graph, [a["key"], a["value"]])
        rewritten += 1
    for node in list(graph.nodes):
        if node.op not in ("call_function", "call_method"):
            continue
        if (found := _absorbed_product(node)) is not None:
            function, args, read = found
            replace_call(graph, node, function, args)
        elif (found := _merged_product(node)) is not None:
            function, args, heads, terms, read = found
            _replace_merged(graph, node, function, args, heads, terms)
        else:
            continue
        erase_if_unused(graph, [read])
        rewritten += 1
    graph.lint()
    gm.recompile()
    return rewritten
