"""The vector scheme's search over the keys' share of the bits: a walk from the middle share,
not every share measured (losses made up: the rule, not a model, is tested)."""
import pytest

from lorc_fx.schemes.vector import KEY_SHARES, least_over_shares


@pytest.mark.parametrize("best", range(len(KEY_SHARES)))
def test_the_walk_finds_the_least_of_a_unimodal_loss_measuring_fewer(best):
    measured = []

    def loss_at(share):
        measured.append(share)
        return abs(KEY_SHARES.index(share) - best) + 0.1 * KEY_SHARES.index(share)

    assert least_over_shares(loss_at) == KEY_SHARES[best]
    assert len(measured) == len(set(measured)) <= len(KEY_SHARES)
    if best >= len(KEY_SHARES) // 2:  # where the planner's shares fell (0.40-0.45)
        assert len(measured) < len(KEY_SHARES)
    assert measured[0] == KEY_SHARES[len(KEY_SHARES) // 2]


def test_a_flat_loss_keeps_the_middle_share_after_one_step_each_way():
    measured = []
    share = least_over_shares(lambda s: measured.append(s) or 1.0)
    middle = len(KEY_SHARES) // 2
    assert share == KEY_SHARES[middle]
    assert measured == [KEY_SHARES[middle], KEY_SHARES[middle + 1], KEY_SHARES[middle - 1]]
