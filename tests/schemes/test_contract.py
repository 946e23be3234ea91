"""Every registered storage scheme through one contract: its candidates plan within the
budget, the cache holds what the plan says and keeps it through crop, beam reorder and batch
select, decoding token by token stores what one forward stores and scores as it does, a
static cache exists exactly where the scheme says it does, the plan file gives the same plan
back, and the report says what the scheme stores.

A scheme added to ``lorc_fx.schemes`` is held to this contract with no test of its own: the
plans are made the way the search makes them (``Scheme.candidates`` of a search context),
at the first of ``BUDGETS`` where the scheme offers one."""
import pytest
import torch

from lorc_fx.analysis import analyze
from lorc_fx.api import compress, load_plan, save_plan
from lorc_fx.cache import latent_cache
from lorc_fx.eval.evaluate import decoded_logits
from lorc_fx.plan.options import CalibrationOptions, PlanOptions
from lorc_fx.plan.schedules import UnreachableFraction
from lorc_fx.plan.scheme import SCHEMES
from lorc_fx.search.candidates import over_budget
from lorc_fx.search.planning import search_context
from helpers.families import VOCAB, build, config_for

# bits per value: plain int8 (10.25 here: the values of a head of 8 channels share one scale),
# low rank and keys water-filled fit the first; vector codes are planned only below every
# plain quantization, at the second
BUDGETS = (10.5, 3.0)
CALIBRATION = CalibrationOptions(tokens=512, window=64)
TOKENS = 24


@pytest.fixture(scope="module")
def model():
    return build(config_for("llama", heads=4, kv_heads=2, layers=2))


@pytest.fixture(scope="module")
def plans(model, tmp_path_factory) -> dict:
    """Each registered scheme's first plan within the budget, as the search builds it."""
    out = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LORC_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        blocks = analyze(model)
        for budget in BUDGETS:
            search = search_context(model, blocks, PlanOptions(
                bits_per_value=budget, basis="weight", schedule="uniform",
                calibration=CALIBRATION))
            for name, scheme in SCHEMES.items():
                for candidate in scheme.candidates(search) if name not in out else ():
                    try:
                        plan, _ = candidate.build()
                    except UnreachableFraction:
                        continue
                    if not over_budget(plan):
                        out[name] = (budget, plan)
                        break
    return out


@pytest.fixture(params=list(SCHEMES))
def planned(request, model, plans):
    """(scheme, budget, plan) of one registered scheme, installed on the model."""
    if request.param not in plans:
        pytest.fail(f"scheme {request.param!r} offered no plan at {BUDGETS} bits per value")
    budget, plan = plans[request.param]
    compress(model, plan=plan)
    return SCHEMES[request.param], budget, plan


def filled(model, batch: int = 3):
    cache = latent_cache(model)
    ids = torch.randint(3, VOCAB, (batch, TOKENS), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    return cache


def read(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [layer.latents() for layer in cache.layers]


def test_the_plan_is_the_schemes_and_within_its_budget(planned):
    """Within the budget as the search holds a candidate to it (one rank step over at most)."""
    scheme, budget, plan = planned
    assert plan.scheme is scheme and plan.budget.value == budget
    assert not over_budget(plan)
    assert plan.cache_bytes_per_token(4)[1] > 0


def test_the_cache_holds_the_plan_through_crop_reorder_and_select(planned, model):
    """What attention reads moves with every batch operation as a plain tensor would, and a
    crop keeps the first tokens as they were read."""
    cache = filled(model)
    assert cache.get_seq_length() == TOKENS
    before = read(cache)
    order = torch.tensor([2, 0, 1])
    cache.reorder_cache(order)
    for (k, v), (k0, v0) in zip(read(cache), before):
        assert torch.equal(k, k0[order]) and torch.equal(v, v0[order])
    cache.batch_select_indices(torch.tensor([0, 2]))
    kept = [(k[order][[0, 2]], v[order][[0, 2]]) for k, v in before]
    for (k, v), (k0, v0) in zip(read(cache), kept):
        assert torch.equal(k, k0) and torch.equal(v, v0)
    cache.crop(-5)
    assert cache.get_seq_length() == TOKENS - 5
    for (k, v), (k0, v0) in zip(read(cache), kept):
        torch.testing.assert_close(k, k0[..., :TOKENS - 5, :], rtol=0, atol=1e-6)
        torch.testing.assert_close(v, v0[..., :TOKENS - 5, :], rtol=0, atol=1e-6)


def test_decoding_stores_and_scores_as_one_forward_does(planned, model):
    """A prompt in one forward, then one token a step (as ``generate`` feeds the cache): the
    first layer, whose inputs do not depend on the cache, stores what one forward of the same
    tokens stores, to float rounding; the later layers see the newest tokens as decoding
    reads them, so the windows' next-token loss may move, but only within noise (a store that
    read its codes back wrong moved it by orders of magnitude)."""
    ids = torch.randint(3, VOCAB, (2, TOKENS + 9), generator=torch.Generator().manual_seed(1))
    one, decoded = latent_cache(model), latent_cache(model)
    with torch.no_grad():
        logits = {"one": decoded_logits(model, ids, one, None),
                  "decoded": decoded_logits(model, ids, decoded, 5)}
    for x, y in zip(one.layers[0].latents(), decoded.layers[0].latents()):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    loss = {k: torch.nn.functional.cross_entropy(v[:, :-1].transpose(1, 2), ids[:, 1:]).item()
            for k, v in logits.items()}
    assert abs(loss["decoded"] - loss["one"]) < 0.05, loss


def test_a_static_cache_exists_where_the_scheme_says(planned, model):
    scheme, _, _ = planned
    if scheme.capabilities.static_cache:
        cache = latent_cache(model, TOKENS)
        with torch.no_grad():
            model(torch.randint(3, VOCAB, (1, TOKENS)), past_key_values=cache, use_cache=True)
        assert int(cache.get_seq_length()) == TOKENS
    else:
        with pytest.raises(ValueError, match="dynamic cache"):
            latent_cache(model, TOKENS)


def test_the_plan_file_gives_the_plan_back(planned, model, tmp_path):
    scheme, _, plan = planned
    loaded = load_plan(save_plan(model, tmp_path / "plan.safetensors"), model)
    assert loaded.scheme is scheme
    assert loaded.bits_per_value == plan.bits_per_value
    for a, b in zip(loaded.layers, plan.layers):
        assert (a.k_rank, a.v_rank, a.skipped) == (b.k_rank, b.v_rank, b.skipped)
        assert torch.equal(a.k_basis, b.k_basis) and torch.equal(a.v_rebuild, b.v_rebuild)
        for x, y in ((a.k_code, b.k_code), (a.v_code, b.v_code)):
            assert type(x) is type(y) and getattr(x, "spec", x) == getattr(y, "spec", y)
    compress(model, plan=loaded)
    for (k, v), (k0, v0) in zip(read(filled(model)), read(_with(model, plan))):
        assert torch.equal(k, k0) and torch.equal(v, v0)


def _with(model, plan):
    compress(model, plan=plan)
    return filled(model)


def test_the_report_says_what_the_scheme_stores(planned, model):
    scheme, _, plan = planned
    report = compress(model, plan=plan)
    text = str(report)
    assert scheme.how(plan) in text
    assert all(line in text for line in scheme.describe(plan))
    assert report.to_json()["kind"] == scheme.name
    assert scheme.summary(plan)
