"""Bits per key latent row by reverse water-filling (``plan.bit_allocation``)."""
import torch
from hypothesis import given, settings, strategies as st

from lorc_fx.plan.bit_allocation import allocate
from lorc_fx.plan.options import SCALE_BITS

WIDTHS = (3, 4, 8)
GROUP = 64


def _cost(bits: list[list[int]]) -> float:
    return sum(b + 2 * SCALE_BITS / GROUP for layer in bits for b in layer if b)


def _error(bits, energies, rho) -> float:
    return sum(float(e[c]) * (1.0 if b == 0 else float(r[b][c]))
               for layer, e, r in zip(bits, energies, rho) for c, b in enumerate(layer))


@st.composite
def layers(draw):
    """Energies falling along the rows, relative rounding errors falling with the width."""
    seed = draw(st.integers(0, 2 ** 31 - 1))
    gen = torch.Generator().manual_seed(seed)
    energies, rho = [], []
    for _ in range(draw(st.integers(1, 3))):
        rows = draw(st.integers(1, 12))
        energies.append(torch.rand(rows, generator=gen, dtype=torch.float64).sort(descending=True).values)
        base = torch.rand(rows, generator=gen, dtype=torch.float64) * 0.2 + 0.05
        rho.append({b: base * 4.0 ** -(b - 3) for b in WIDTHS})
    return energies, rho


@settings(max_examples=50, deadline=None)
@given(drawn=layers(), budget=st.floats(0, 300), more=st.floats(0, 100))
def test_the_budget_is_kept_and_more_of_it_never_costs_error(drawn, budget, more):
    energies, rho = drawn
    bits = allocate(energies, rho, budget, WIDTHS, GROUP)
    assert [len(b) for b in bits] == [len(e) for e in energies]
    assert all(b in (0, *WIDTHS) for layer in bits for b in layer)
    assert _cost(bits) <= budget + 1e-9
    richer = allocate(energies, rho, budget + more, WIDTHS, GROUP)
    assert _error(richer, energies, rho) <= _error(bits, energies, rho) + 1e-12


def test_rows_of_more_energy_get_at_least_as_many_bits_where_they_round_alike():
    energies = [torch.tensor([8.0, 4.0, 2.0, 1.0, 0.5, 0.25], dtype=torch.float64)]
    rho = [{b: torch.full((6,), 4.0 ** -(b - 2), dtype=torch.float64) for b in WIDTHS}]
    for budget in (0, 10, 20, 30, 45):
        (bits,) = allocate(energies, rho, budget, WIDTHS, GROUP)
        assert bits == sorted(bits, reverse=True), (budget, bits)
    assert allocate(energies, rho, 0, WIDTHS, GROUP) == [[0] * 6]
    assert allocate(energies, rho, 1e9, WIDTHS, GROUP) == [[8] * 6]
