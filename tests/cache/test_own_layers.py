"""A model's own cache layer classes, coded (lorc_fx.cache.own_layers): every state stored as
row codes, read back by the layer's own code, never drifting, aliases held once."""
import pytest
import torch
from transformers.cache_utils import (DYNAMIC_LAYER_TYPE_MAPPING, DynamicLayer,
                                      DynamicSlidingWindowLayer, LinearAttentionLayer)
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HCACache

from lorc_fx.cache.own_layers import coded, codes_own_states, is_coded
from lorc_fx.codes.rows import RowSpec, encode

SPEC = RowSpec(8, 16)


class WindowWithPending(DynamicSlidingWindowLayer):
    """A layer class of a model's own, as DeepSeek-V4's: a window whose keys are its values
    (rewritten from a concatenation each step), and a dict of pending rows."""

    def __init__(self, sliding_window: int = 6):
        super().__init__(sliding_window=sliding_window)
        self.pending = {"rows": None}

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.values = self.keys
        self.cumulative_length += key_states.shape[-2]
        full = torch.cat([self.keys, key_states], dim=-2)
        self.keys = full[:, :, -self.sliding_window + 1:, :]
        self.values = self.keys
        return full, full


def test_only_layer_classes_of_a_models_own_are_coded_so():
    assert codes_own_states(WindowWithPending) and codes_own_states(DeepseekV4HCACache)
    assert not any(codes_own_states(k) for k in (DynamicLayer, DynamicSlidingWindowLayer,
                                                  LinearAttentionLayer))


def test_a_window_rewritten_every_step_holds_its_rows_as_coded_once():
    """200 one-token steps: the window read back is each of its last rows coded once (no
    drift from recoding what was decoded), and its keys and values share one set of codes."""
    layer = coded(WindowWithPending(), SPEC)
    rows = torch.randn(200, 1, 2, 1, 16) * torch.logspace(-3, 2, 200).view(200, 1, 1, 1, 1)
    for i, row in enumerate(rows):
        full, same = layer.update(row, row)
        assert full is same and torch.equal(full[:, :, -1:], row)
    window = torch.cat(list(rows[-5:]), dim=-2)
    assert torch.equal(layer.keys, encode(window, SPEC).decode())
    assert torch.equal(layer.values, layer.keys)
    assert len(layer.row_codes()) == 1 and layer.cached_values() == window.numel()


def test_dict_states_are_coded_and_every_state_counted():
    layer = coded(WindowWithPending(), SPEC)
    layer.update(torch.randn(1, 2, 3, 16), None)
    pending = torch.randn(1, 4, 32)
    layer.pending["rows"] = pending
    assert torch.equal(layer.pending["rows"], encode(pending, SPEC).decode())
    assert dict(layer.pending.items())["rows"].shape == pending.shape
    held = sum(t.numel() * t.element_size() for t in layer.tensors())
    assert held == (2 * 3 * 16 + 4 * 32) * SPEC.bits_per_value() / 8
    layer.pending["rows"] = None
    assert layer.pending["rows"] is None and len(layer.row_codes()) == 1


def test_a_coded_layer_keeps_its_class_and_registers_nothing():
    mapping = dict(DYNAMIC_LAYER_TYPE_MAPPING)
    layer = coded(WindowWithPending(), SPEC)
    assert isinstance(layer, WindowWithPending) and is_coded(layer)
    assert DYNAMIC_LAYER_TYPE_MAPPING == mapping


class WritesInPlace(WindowWithPending):
    """A layer adding into its window in place, assigning it back or not."""

    def update(self, key_states, value_states, *args, assign=True, **kwargs):
        if not self.is_initialized:
            return super().update(key_states, value_states)
        window = self.keys
        window[..., -1:, :] += key_states
        if assign:
            self.keys = window
        return window, window


def test_an_in_place_write_counts_once_assigned_and_is_refused_otherwise():
    layer = coded(WritesInPlace(), SPEC)
    first, added = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 1, 16)
    layer.update(first, None)
    window, _ = layer.update(added, None)
    assert torch.equal(layer.keys, encode(window, SPEC).decode())
    written, _ = layer.update(added, None, assign=False)  # the caller still holds the copy
    with pytest.raises(RuntimeError, match="WritesInPlace wrote into a state it read, in place"):
        layer.keys
