"""A vector plan through the cache: latents at full rank coded as product vector codes
(``cache.stores.vector``), built as the ``vector`` scheme builds it on a tiny random llama
(books fitted on its latents of random tokens, a few Lloyd iterations)."""
import sys
from collections import Counter
from dataclasses import replace

import pytest
import torch

from lorc_fx.analysis import analyze
from lorc_fx.api import compress, load_plan, save_plan
from lorc_fx.cache import latent_cache
from lorc_fx.cache.layers import LatentStaticSlidingLayer
from lorc_fx.cache.stores.vector import VectorStore
from lorc_fx.cache.stores.vector_static import VectorStaticStore
from lorc_fx.codes.integer import QuantSpec
from lorc_fx.codes.vector import BLOCK, VectorBook, VectorSpec, decode, encode
from lorc_fx.compile.backend import lorc_backend
from lorc_fx.plan.options import RECENT_DIVISOR, PlanOptions
from lorc_fx.plan.planner import plan_layers, without_sliding_latents
from lorc_fx.plan.schedules import UnreachableFraction
from lorc_fx.schemes.vector import vector_plan
from lorc_fx.search.codebooks import calibration_latents, fit_books
from lorc_fx.search.context import model_layer_inputs
from helpers.families import VOCAB, build, config_for
from helpers.pass_helpers import compiled, generate, prompt

BUDGET = 3.0  # bits per value: the RoPE angle log and the sinks leave ~1.5 to the codes
WIDTHS = (1, 2, 4)


@pytest.fixture(scope="module")
def model():
    return build(config_for("llama", heads=4, kv_heads=2, layers=2))


@pytest.fixture(scope="module", params=["reconstruct"])
def plan(model, request):
    mode = dict(objective="speed") if request.param == "speed" else dict(rope=request.param)
    return _vector_plan(model, BUDGET, **mode)


def _vector_plan(model, budget: float, **mode):
    """The vector plan of ``model`` at ``budget`` bits per value, as the scheme makes it
    (cheaper: weight bases, a few Lloyd iterations)."""
    done = compress(model, 1.0, schedule="uniform", basis="weight", **mode).plan
    blocks = analyze(model)  # as the scheme plans: sliding layers take plain codes, no latents
    inputs = without_sliding_latents(model_layer_inputs(model, blocks, 1))
    full = replace(plan_layers(inputs, done.options), fingerprint=done.fingerprint)
    windows = torch.randint(3, VOCAB, (8, 64), generator=torch.Generator().manual_seed(0))
    samples = calibration_latents(model, blocks, full, windows)
    books, errors = fit_books(samples, WIDTHS, iters=3)
    options = PlanOptions.of(full.options, bits_per_value=budget)
    return vector_plan(full, inputs, options, books, errors, 0.5)


def forward(model, tokens, cache):
    with torch.no_grad():
        n = tokens.shape[1]
        start = cache.get_seq_length()
        model(tokens, past_key_values=cache, use_cache=True,
              position_ids=torch.arange(start, start + n).expand(tokens.shape[0], n))


def test_the_plan_codes_every_layer_within_the_budget(plan):
    assert plan.scheme.name == "vector"
    assert BUDGET - 0.5 < plan.bits_per_value <= BUDGET + 1e-9
    for l in plan.layers:
        for book, rank in ((l.k_code, l.k_rank), (l.v_code, l.v_rank)):
            assert book is not None and book.spec.width == rank > 0
            assert {b for _, b in book.spec.runs} <= set(WIDTHS)


def test_chunked_updates_hold_what_one_update_holds_and_their_bytes(model, plan):
    """Blocks are coded alone, so a prefill then one token a step holds the codes of one
    prefill of all the tokens; attention reads position 0 as it came (the sink), every other
    token decoded; the bytes are the codes', the sink's, the window's and the drift
    table's."""
    compress(model, plan=plan)
    tokens = torch.randint(3, VOCAB, (2, 29), generator=torch.Generator().manual_seed(1))
    whole, steps = latent_cache(model), latent_cache(model)
    forward(model, tokens, whole)
    forward(model, tokens[:, :13], steps)
    for i in range(13, 29):
        forward(model, tokens[:, i:i + 1], steps)
    for a, b in zip(whole.layers, steps.layers):
        assert isinstance(a.k_store, VectorStore) and a.get_seq_length() == 29
        for x, y in zip(a.latents(), b.latents()):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
        side = a.k_store
        # 1 recent token (1/256), then the partial block
        assert side.coded == side.book.coded(29) == 24 and side.book.recent_divisor == 256
        assert side.window_tokens(a.keys).shape[-2] == 29 - 24
        read = a.latents()[0]
        torch.testing.assert_close(read[:, :, 0], side.sink[:, :, 0])
        coded = decode(side.codes, side.book)[:, None]
        torch.testing.assert_close(read[:, :, 1:side.coded], coded[:, :, 1:])
        assert side.codes.nbytes == side.book.spec.nbytes(2, side.coded)
    itemsize = 4  # float32 model
    r = sum(l.k_rank + l.v_rank for l in plan.layers)
    codes = sum(side.codes.nbytes for l in whole.layers for side in (l.k_store, l.v_store))
    drift_rows = -(-29 // plan.options.drift_chunk)  # a row of drift offsets a chunk reached
    assert whole.cache_bytes() == (codes + 2 * r * itemsize * (1 + 29 - 24)
                                   + 2 * r * itemsize * drift_rows
                                   + sum(t.nbytes for t in whole.rotary.tensors()))


def test_a_long_cache_holds_at_most_the_bits_its_plan_counts_the_recent_window_among_them(
        model, plan):
    """At 2048 tokens (the plan counts the sink as if sequences were 512 long) the cache holds
    at most the plan's bits a token, and more than the plan's bits without the recent
    window's 1/256 of the tokens in floats: the planner pays for the window it keeps."""
    compress(model, plan=plan)
    n, float_bits = 2048, 32  # a float32 model
    cache = latent_cache(model)
    forward(model, torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(4)),
            cache)
    held = 8 * cache.cache_bytes()
    counted = n * plan.bits_per_token(float_bits)
    window = n * sum(l.k_rank + l.v_rank for l in plan.layers) * float_bits / RECENT_DIVISOR
    assert plan.options.recent_divisor == RECENT_DIVISOR
    assert counted - window < held <= counted


@pytest.mark.parametrize("recent_divisor", [0, 4])
def test_a_store_fed_block_by_block_reads_what_one_append_reads(recent_divisor):
    """Decoding appends a block of codes at a time: every index width (4 bits a channel packs
    two indices a byte, 2.5 bits five-bit indices, 1.5 six-bit ones) reads back as the codes
    of one append of all the tokens, and cuts to the same prefix. With a recent window (a
    quarter of the tokens) a cut keeps its whole blocks coded, fewer tokens than the window
    would hold, and tokens appended after it are coded only once the window passes them."""
    spec = VectorSpec(((4, 4), (4, 2.5), (8, 1.5)), tuple_dims=8)
    book = replace(_book(spec), recent_divisor=recent_divisor)
    latents = torch.randn(2, 1, 37, spec.width, generator=torch.Generator().manual_seed(1))
    whole, steps = VectorStore(book), VectorStore(book)
    whole_window = whole.append(torch.tensor([]), latents)
    window = steps.append(torch.tensor([]), latents[:, :, :5])
    for t in range(5, 37):
        window = steps.append(window, latents[:, :, t:t + 1])
        assert steps.coded == book.coded(t + 1)
    assert torch.equal(steps.read(window), whole.read(whole_window))
    read = steps.read(window)
    window = steps.cut(window, 19)
    assert torch.equal(steps.read(window), whole.read(whole.cut(whole_window, 19)))
    assert steps.coded == 16 >= book.coded(19)
    for t in range(19, 37):
        window = steps.append(window, latents[:, :, t:t + 1])
        assert steps.coded == max(16, book.coded(t + 1))
    assert torch.equal(steps.read(window)[:, :, :16], read[:, :, :16])


@pytest.mark.parametrize("recent_divisor", [0, 4])
def test_a_static_store_holds_the_codes_of_one_encode_and_reads_as_the_dynamic_one(
        recent_divisor):
    """Written in place from any offset (a prefill of 13, then one token a step, then 5),
    the static store's blocks hold, byte for byte, the codes one ``encode`` of every token
    stores; it reads every written token decoded but the recent ones the dynamic store keeps
    in its window (the partial block; with a recent window, the last quarter of the tokens
    too) and each row's sink, which it reads as it came (row 1's at position 2, placed before
    the first write): after every write, what a dynamic store fed alike reads."""
    book = replace(_book(VectorSpec(((4, 4), (4, 2.5), (8, 1.5)), tuple_dims=8)),
                   recent_divisor=recent_divisor)
    latents = torch.randn(2, 1, 37, book.spec.width, generator=torch.Generator().manual_seed(1))
    store, dynamic = VectorStaticStore(book), VectorStore(book)
    store.place_sinks(torch.tensor([0, 2]))
    dynamic.place_sinks(torch.tensor([0, 2]))
    window = store.allocate(latents, torch.eye(book.spec.width), 40)
    assert window.shape[2] == book.exact_rows(40) == (-(-40 // recent_divisor) if recent_divisor
                                                      else 0) + BLOCK - 1
    held, start = torch.tensor([]), 0
    for t in [13] + [1] * 19 + [5]:
        store.write(window, latents[:, :, start:start + t],
                    torch.arange(start, start + t), torch.tensor(start))
        held = dynamic.append(held, latents[:, :, start:start + t])
        start += t
        assert torch.equal(store.read(window)[:, :, :start], dynamic.read(held))
    whole = encode(latents[:, 0, :32], book)
    for packed, once, (*_, ib) in zip(store.payload, whole.payload, book.spec.layout()):
        assert torch.equal(packed.flatten(-2)[..., :32 // BLOCK * ib], once)
    coded = book.coded(37)
    assert coded == (24 if recent_divisor else 32) == dynamic.coded
    read = store.read(window)[:, :, :37]
    expected = decode(encode(latents[:, 0], book), book)[:, None]
    expected[:, :, coded:] = latents[:, :, coded:]
    expected[0, :, 0], expected[1, :, 2] = latents[0, :, 0], latents[1, :, 2]
    torch.testing.assert_close(read, expected)


def test_drift_offsets_code_each_chunk_about_its_drift_from_the_first():
    """Latents drifting away from the books (a ramp of 0.15 a token): a prefill measures each
    16-token chunk's mean but the sink's, and codes every chunk about its offset from the
    first, which it codes as without offsets, bit for bit; later chunks come back far closer
    than without offsets, and a chunk the prefill did not reach takes the last offset. The
    static store written alike reads what the dynamic one holds as codes; cut and batch
    selection keep each token as it was read."""
    spec = VectorSpec(((4, 4), (4, 2.5), (8, 1.5)), tuple_dims=8)
    plain, drifting = _book(spec), replace(_book(spec), drift_chunk=16)
    gen = torch.Generator().manual_seed(3)
    latents = torch.randn(2, 1, 60, spec.width, generator=gen) + 0.15 * torch.arange(60.)[:, None]

    def fed(store, prefill=40):
        window = store.append(torch.tensor([]), latents[:, :, :prefill])
        for t in range(prefill, 60):
            window = store.append(window, latents[:, :, t:t + 1])
        return window

    ours, theirs = VectorStore(drifting), VectorStore(plain)
    window = fed(ours)
    read, without = ours.read(window), theirs.read(fed(theirs))
    assert torch.equal(read[:, :, :16], without[:, :, :16])
    means = torch.stack([latents[:, 0, 1:16].mean(1), latents[:, 0, 16:32].mean(1),
                         latents[:, 0, 32:40].mean(1)], 1)
    torch.testing.assert_close(ours.means[:, :3], means)
    assert torch.equal(ours.means[:, 3], ours.means[:, 2])  # past the prefill: the last
    err = lambda x: (x[:, :, 16:56] - latents[:, :, 16:56]).pow(2).mean()  # noqa: E731
    assert err(read) < err(without) / 4
    static = VectorStaticStore(drifting)
    static_window = static.allocate(latents, torch.eye(spec.width), 64)
    start = 0
    for t in [40] + [1] * 20:
        static.write(static_window, latents[:, :, start:start + t],
                     torch.arange(start, start + t), torch.tensor(start))
        start += t
    torch.testing.assert_close(static.read(static_window)[:, :, :ours.coded],
                               read[:, :, :ours.coded])
    window = ours.cut(window, 37)
    torch.testing.assert_close(ours.read(window), read[:, :, :37])
    ours.map_batch(lambda x: x[1:])
    torch.testing.assert_close(ours.read(window[1:]), read[1:, :, :37])


@pytest.mark.inductor
def test_inductor_codes_and_reads_as_eager():
    """The stores' steps lowered by Inductor (C++ on CPU: nearest codewords, bit packing,
    the splice and the gathers) code and read what eager stores do, step by step: a dynamic
    store's 11 one-token appends after a 37-token prompt (two blocks fill), in one graph for
    every step, and a static store's writes. Two runs (two-per-byte and five-bit indices):
    the compile is what takes the time. Drift offsets each 16 positions: the prompt measures
    three chunks, the steps write the third's last tokens."""
    book = replace(_book(VectorSpec(((4, 4), (4, 2.5)), tuple_dims=8)), drift_chunk=16)
    latents = torch.randn(2, 1, 48, book.spec.width, generator=torch.Generator().manual_seed(2))
    latents = latents + 0.1 * torch.arange(48.)[:, None]  # a drift to code

    def append(store, window, new):
        window = store.append(window, new)
        return window, store.read(window)

    def write(store, window, new, start):
        positions = torch.arange(new.shape[-2]) + start
        store.write(window, new, positions, start)
        return store.read(window)

    torch._dynamo.reset()
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled_append, compiled_write = torch.compile(append), torch.compile(write)
    eager, lowered = VectorStore(book), VectorStore(book)
    ours = eager.append(torch.tensor([]), latents[:, :, :37])
    theirs = lowered.append(torch.tensor([]), latents[:, :, :37])
    for t in range(37, 48):
        ours, expected = append(eager, ours, latents[:, :, t:t + 1])
        for tensor, dim in lowered.token_axes(theirs):
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
        theirs, got = compiled_append(lowered, theirs, latents[:, :, t:t + 1])
        torch.testing.assert_close(got, expected)
    assert lowered.coded == eager.coded == 48  # the spare slots' bytes may differ
    assert not torch.equal(eager.means[:, 2], eager.means[:, 0])
    assert all(torch.equal(a, b) for a, b in zip(lowered.codes.payload, eager.codes.payload))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames == 1
    static_eager, static_lowered = VectorStaticStore(book), VectorStaticStore(book)
    windows = [s.allocate(latents, torch.eye(book.spec.width), 48)
               for s in (static_eager, static_lowered)]
    for start, t in ((0, 37), (37, 1), (38, 1), (39, 5)):
        new, at = latents[:, :, start:start + t], torch.tensor(start)
        torch.testing.assert_close(compiled_write(static_lowered, windows[1], new, at),
                                   write(static_eager, windows[0], new, at))
    assert all(torch.equal(a, b) for a, b in zip(static_lowered.payload, static_eager.payload))


def _book(spec: VectorSpec) -> VectorBook:
    gen = torch.Generator().manual_seed(0)
    tables = []
    for _, subs, d, ib in spec.layout():
        codewords = torch.randn(subs, 1 << ib, d, generator=gen)
        tables.append((codewords, codewords))
    return VectorBook(spec, tuple(tables))


def test_crop_keeps_the_first_tokens_as_they_were_read(model, plan):
    compress(model, plan=plan)
    cache = latent_cache(model)
    forward(model, torch.randint(3, VOCAB, (2, 27)), cache)
    before = [layer.latents() for layer in cache.layers]
    for keep in (20, 16, 5):
        cache.crop(keep - cache.get_seq_length())
        assert cache.get_seq_length() == keep
        for layer, old in zip(cache.layers, before):
            for x, y in zip(layer.latents(), old):
                torch.testing.assert_close(x, y[:, :, :keep])


def test_generate_continues_a_returned_cache_and_runs_beams(model, plan, tmp_path):
    """Greedy decode in two calls, the second continuing the first's cache, gives the tokens
    of one call (left padding in the batch); beams and batch expansion run; the plan saved
    and loaded again gives the same tokens."""
    compress(model, plan=plan)
    ids, mask = prompt(length=6)
    once = generate(model, ids, mask, new_tokens=20)
    assert isinstance(once.past_key_values.layers[0].k_store, VectorStore)
    first = generate(model, ids, mask, new_tokens=9)
    more = torch.cat([mask, torch.ones(2, 9, dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        second = model.generate(first.sequences, attention_mask=more, max_new_tokens=11,
                                do_sample=False, past_key_values=first.past_key_values)
    assert torch.equal(second, once.sequences)
    beams = generate(model, ids, mask, new_tokens=10, num_beams=3, num_return_sequences=2)
    assert beams.sequences.shape == (4, 16)
    loaded = load_plan(save_plan(plan, tmp_path / "vector.safetensors"), model)
    assert [l.k_code.spec for l in loaded.layers] == [l.k_code.spec for l in plan.layers]
    assert {(l.k_code.recent_divisor, l.v_code.drift_chunk) for l in loaded.layers} == {
        (plan.options.recent_divisor, plan.options.drift_chunk)}
    compress(model, plan=loaded)
    assert torch.equal(generate(model, ids, mask, new_tokens=20).sequences, once.sequences)


@pytest.mark.parametrize("cache", [None, "static"])
@pytest.mark.parametrize("plan", ["reconstruct", "commute", "speed"], indirect=True)
def test_compiled_decode_reads_the_codes_in_one_graph_without_breaks(model, plan, cache, caplog,
                                                                    monkeypatch):
    """Compiled (the passes, without Inductor): coding and decoding are in the graph, no
    break, two graphs (prefill, and one for every decode step), the eager tokens and logits.
    Dynamic: a prompt of 6 and 30 new tokens settle blocks inside the decode graph, and what
    attention reads is gathered (no tensor of the coded tokens alone, 0 until a block fills).
    Static: every write packs its tokens' indices into their blocks in place, each row's sink
    where it falls (row 1's after its left padding). Every decode attention reads the codes
    (``lorc::vector_sums``; keys cached after RoPE ``lorc::vector_scores`` too, no latent
    decoded; keys before RoPE in a RoPE-commuting basis, ``objective="speed"``,
    ``lorc::vector_turned_scores``, no latent decoded either)."""
    from torch._dynamo.utils import counters

    # as in a new process (the package's ``install`` function hides its module's name)
    monkeypatch.setattr(sys.modules["lorc_fx.cache.install"], "_LIMITS_SAID", set())
    with caplog.at_level("WARNING", logger="lorc_fx.cache.install"):
        compress(model, plan=plan)
        assert "slower than the full cache" in caplog.text and "refused" not in caplog.text
        caplog.clear()
        compress(model, plan=plan)
    assert "slower than the full cache" not in caplog.text  # said once a process
    ids, mask = prompt(length=6)
    eager = generate(model, ids, mask, cache, new_tokens=30)
    graphs = []
    backend = lorc_backend.with_options(inductor=False)

    def spy(gm, example_inputs):
        compiled_fn = backend(gm, example_inputs)
        graphs.append(gm)  # as the passes left it
        return compiled_fn

    counters.clear()
    with compiled(model, spy):
        got = generate(model, ids, mask, cache, new_tokens=30)
        with torch.profiler.profile() as profile:  # compiled: what the steps run
            generate(model, ids, mask, cache, new_tokens=30)
    assert sum(counters["graph_break"].values()) == 0
    assert len(graphs) == 2
    assert torch.equal(got.sequences, eager.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(eager.logits),
                               atol=1e-4, rtol=1e-4)
    # the prompt (6 tokens: read as stored, as a decode step) and 29 steps, every layer
    attentions = 30 * model.config.num_hidden_layers
    assert [r.absorbed for r in backend.reports] == [model.config.num_hidden_layers] * 2
    calls = Counter(e.name for e in profile.events())
    commute, turned = plan.options.rope == "commute", plan.options.objective == "speed"
    assert calls["lorc::vector_sums"] == attentions
    assert calls["lorc::vector_scores"] == (attentions if commute else 0)
    assert calls["lorc::vector_turned_scores"] == (attentions if turned else 0)
    assert calls["lorc::vector_latents"] == 0
    assert calls["lorc::vector_decode"] == (0 if commute or turned else attentions)
    if cache == "static":
        layer = got.past_key_values.layers[0]
        assert isinstance(layer.k_store, VectorStaticStore)
        assert layer.k_store.sink_at.tolist() == [0, 2]


@pytest.mark.parametrize("cache", [None, "static"])
@pytest.mark.parametrize("plan", ["reconstruct", "commute", "speed"], indirect=True)
def test_compiled_decode_reads_drift_offsets_as_eager(model, plan, cache):
    """Drift offsets each 16 positions, a 24-token prompt (two chunks measured, the steps
    reaching two more): compiled (the passes, without Inductor) in two graphs, decode
    attention adds each chunk's offset to the scores of its slots (keys after RoPE; keys
    before RoPE in a RoPE-commuting basis, turned by each slot's angles) or to the keys
    rebuilt (before RoPE) and to the value sums, and generates the eager tokens."""
    plan = _with_drift(plan, 16)
    compress(model, plan=plan)
    ids, mask = prompt(length=24)
    eager = generate(model, ids, mask, cache, new_tokens=30)
    offsets = [layer.k_store.means for layer in eager.past_key_values.layers]
    assert all(not torch.equal(m[:, 1], m[:, 0]) for m in offsets)
    graphs = []
    backend = lorc_backend.with_options(inductor=False)

    def spy(gm, example_inputs):
        graphs.append(gm)
        return backend(gm, example_inputs)

    with compiled(model, spy):
        got = generate(model, ids, mask, cache, new_tokens=30)
    assert len(graphs) == 2
    assert [r.absorbed for r in backend.reports][-1] == model.config.num_hidden_layers
    assert torch.equal(got.sequences, eager.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(eager.logits),
                               atol=1e-4, rtol=1e-4)


def _with_drift(plan, chunk: int):
    """``plan`` with its books' drift offsets each ``chunk`` positions."""
    return replace(plan, options=replace(plan.options, drift_chunk=chunk), layers=[
        replace(l, k_code=replace(l.k_code, drift_chunk=chunk),
                v_code=replace(l.v_code, drift_chunk=chunk)) for l in plan.layers])


@pytest.mark.parametrize("cache", [None, "static"])
@pytest.mark.parametrize("family", ["gpt_oss", "bloom"])
def test_manual_attention_reads_the_codes_in_compiled_decode(family, cache):
    """Manual attention over vector codes (gpt-oss: ``matmul`` products with a sink logit
    between; BLOOM: heads merged into the batch, ``baddbmm`` with ALiBi): compiled (the
    passes, without Inductor) its decode graph scores and sums every layer from the codes,
    no latent decoded, and generates the eager tokens and logits; a static cache's recent
    tokens are read from its ring, wrapped around within the 12 steps."""
    model = build(config_for(family, heads=4, kv_heads=2, layers=2))
    compress(model, plan=_vector_plan(model, BUDGET))
    ids, mask = prompt(length=6)
    eager = generate(model, ids, mask, cache, new_tokens=12)
    backend = lorc_backend.with_options(inductor=False)
    with compiled(model, backend):
        got = generate(model, ids, mask, cache, new_tokens=12)
        with torch.profiler.profile() as profile:
            generate(model, ids, mask, cache, new_tokens=12)
    assert torch.equal(got.sequences, eager.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(eager.logits),
                               atol=1e-4, rtol=1e-4)
    attentions = 12 * model.config.num_hidden_layers  # the prompt (read as stored) and 11 steps
    calls = Counter(e.name for e in profile.events())
    assert calls["lorc::vector_scores"] == calls["lorc::vector_sums"] == attentions
    assert calls["lorc::vector_decode"] == calls["lorc::vector_latents"] == 0


@pytest.mark.inductor
def test_inductor_decodes_the_eager_tokens(model, plan):
    """Through the whole backend, Inductor included, over a static cache (the one
    ``generate`` builds for a model compiled in place): the eager tokens, the codes written
    and decoded by the ``lorc::vector_*`` ops inside the compiled steps."""
    compress(model, plan=plan)
    ids, mask = prompt(length=6)
    eager = generate(model, ids, mask, "static", new_tokens=12)
    with compiled(model, lorc_backend):
        got = generate(model, ids, mask, "static", new_tokens=12)
    assert isinstance(got.past_key_values.layers[0].k_store, VectorStaticStore)
    assert torch.equal(got.sequences, eager.sequences)


def test_a_left_padded_row_keeps_its_first_token_as_it_came(model, plan):
    """generate places each row's sink after its left padding (from the attention mask): the
    padded row reads its first token as it came and its other prompt tokens coded, as it
    does alone, unpadded (each token is coded on its own, so padding moves no code once both
    runs have coded their prompts)."""
    compress(model, plan=plan)
    ids, mask = prompt(length=6)  # row 1: two pad tokens first
    both = generate(model, ids, mask, new_tokens=16)
    alone = generate(model, ids[1:, 2:], mask[1:, 2:], new_tokens=16)
    assert both.sequences[1, 2:7].tolist() == alone.sequences[0, :5].tolist()
    for padded, single in zip(both.past_key_values.layers, alone.past_key_values.layers):
        assert padded.k_store.sink_at.tolist() == [0, 2] and single.k_store.coded >= 8
        for x, y in zip(padded.latents(), single.latents()):  # the prompt and first new token
            torch.testing.assert_close(x[1, :, 2:7], y[0, :, :5], atol=1e-5, rtol=1e-5)


@pytest.mark.inductor
def test_a_sliding_layer_beside_vector_codes_stores_plain_codes(tmp_path):
    """Vector codes do not store a sliding-window layer's ring: a vector plan stores its keys
    and values as 4-bit plain codes and counts them so (kept full, the layer alone would
    spend more than the budget); eager and compiled (Inductor, a static cache: the ring
    beside the codes' store) decode the same tokens; the plan saved and loaded again keeps
    the layer's codes."""
    model = build(config_for("qwen2_sliding", heads=4, kv_heads=2, layers=2))  # layer 1 slides
    budget = 4.5
    plan = _vector_plan(model, budget)
    whole, sliding = plan.layers
    assert isinstance(whole.k_code, VectorBook) and isinstance(whole.v_code, VectorBook)
    assert isinstance(sliding.k_code, QuantSpec) and sliding.k_code.bits == 4
    assert isinstance(sliding.v_code, QuantSpec) and sliding.v_code.bits == 4
    assert plan.bits_per_value <= budget + 1e-9  # the books' widest codes: 4 bits
    assert replace(plan, layers=[whole, replace(sliding, k_code=None, v_code=None)]
                   ).bits_per_value > budget
    with pytest.raises(UnreachableFraction, match="alone hold") as refused:
        _vector_plan(model, 2.0)  # below what the sliding layer's codes and the sinks hold
    assert 2.0 < refused.value.lowest < plan.bits_per_value
    compress(model, plan=plan)
    ids, mask = prompt(length=6)
    eager = generate(model, ids, mask, "static", new_tokens=12)
    assert isinstance(eager.past_key_values.layers[1], LatentStaticSlidingLayer)
    with compiled(model, lorc_backend):
        got = generate(model, ids, mask, "static", new_tokens=12)
    assert torch.equal(got.sequences, eager.sequences)
    loaded = load_plan(save_plan(plan, tmp_path / "sliding.safetensors"), model)
    assert (loaded.layers[1].k_code, loaded.layers[1].v_code) == (sliding.k_code, sliding.v_code)
