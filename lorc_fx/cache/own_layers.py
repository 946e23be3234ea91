"""Cache layers of a model's own class, coded: every state the layer holds stored as row codes.

Some models register cache layer classes of their own (DeepSeek-V4: a sliding window whose
keys are its values, beside a compressor's pending tokens, its compressed long-range entries
and an indexer's keys, each growing or churning its own way). lorc_fx cannot know what each
state means, and needs not: coding what a cache layer stores changes nothing of how attention
computes it (as ``schemes.plain``'s plans without the graph). So :func:`coded` makes such a
layer store every floating tensor it assigns (an attribute, or an entry of a dict attribute)
as row codes (``codes.rows``) and read it back decoded, by the layer's own code, unchanged.

Invariants:
- What a layer rewrites from what it read (a window cut from a concatenation, the buffer's
  leftover, a batch reorder) codes to the very same codes: row codes are exact when coded
  again, so nothing drifts however many steps a row is rewritten.
- A decoded tensor assigned again elsewhere (``self.values = self.keys``) shares its codes: a
  state held once by the model is held once coded.
- ``tensors()`` is every tensor the layer holds for its states, each once.
- A state is read as a fresh decoded tensor, so what a layer writes into one in place counts
  only once it is assigned back (then it is coded afresh). A layer class must assign what it
  keeps, as transformers' dynamic layers and DeepSeek-V4's do; an in-place write left
  unassigned is refused at the layer's next read or assignment while the written tensor
  lives (tensors' version counters).
"""
from __future__ import annotations

import functools
import math

import torch
from torch.utils.weak import WeakIdKeyDictionary
from transformers import cache_utils
from transformers.cache_utils import DynamicLayer

from lorc_fx.codes.rows import RowCodes, RowSpec, encode


def codes_own_states(kind: type) -> bool:
    """Whether ``kind`` is a cache layer class a model defines for itself (not one of
    transformers' own) that holds keys and values (a ``DynamicLayer``): what :func:`coded`
    stores as row codes."""
    return isinstance(kind, type) and issubclass(kind, DynamicLayer) \
        and kind.__module__ != cache_utils.__name__ \
        and kind.__setattr__ is object.__setattr__ and not hasattr(kind, "__getattr__")


class _Coder:
    """Codes what a layer assigns, and remembers which decoded tensor came from which codes
    (so an alias is coded once) at which version (so an in-place write into one is caught)."""

    def __init__(self, spec: RowSpec, layer: str):
        self.spec, self.layer = spec, layer
        self.decoded: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> (codes, version)

    def _unchanged(self, assigned=None) -> None:
        for tensor, (_, version) in list(self.decoded.items()):
            if tensor._version != version and tensor is not assigned:
                raise RuntimeError(f"{self.layer} wrote into a state it read, in place: its "
                                   "states are held as row codes and read as decoded copies, "
                                   "so the write would be lost; this layer class cannot be "
                                   "coded (compress with latent_bits=16 to leave it as built)")

    def wrap(self, value):
        self._unchanged(assigned=value)
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() >= 2 \
                and value.numel():
            codes, version = self.decoded.get(value, (None, None))
            if version != value._version:  # new, or read and written into since
                codes = encode(value, self.spec)
                if version is not None:
                    self.decoded[value] = codes, value._version
            return codes
        if type(value) is dict:
            return _CodedDict(self, value)
        return value

    def read(self, value):
        self._unchanged()
        if isinstance(value, RowCodes):
            tensor = value.decode()
            self.decoded[tensor] = value, tensor._version
            return tensor
        return value


class _CodedDict(dict):
    """A dict attribute of a coded layer (its states by name): entries coded as assigned,
    decoded as read."""

    def __init__(self, coder: _Coder, entries: dict):
        super().__init__()
        self._coder = coder
        for name, value in entries.items():
            self[name] = value

    def __setitem__(self, name, value):
        super().__setitem__(name, self._coder.wrap(value))

    def __getitem__(self, name):
        return self._coder.read(super().__getitem__(name))

    def get(self, name, default=None):
        return self[name] if name in self else default

    def values(self):
        return [self[name] for name in self]

    def items(self):
        return [(name, self[name]) for name in self]

    def held(self) -> list[RowCodes]:
        return [v for v in super().values() if isinstance(v, RowCodes)]


class _CodedStates:
    """Policy of a coded layer: a codable value assigned to an attribute is kept under the
    layer's ``_coded`` entries and the attribute itself removed, so reading it falls through
    to ``__getattr__``, which decodes (no cost on any other attribute)."""

    __slots__ = ()
    _coder: _Coder

    def __setattr__(self, name, value):
        value = self._coder.wrap(value) if not name.startswith("_") else value
        coded = self.__dict__.setdefault("_coded", {})
        if isinstance(value, RowCodes):
            self.__dict__.pop(name, None)
            coded[name] = value
        else:
            coded.pop(name, None)
            object.__setattr__(self, name, value)

    def __getattr__(self, name):
        coded = self.__dict__.get("_coded", {})
        if name in coded:
            return self._coder.read(coded[name])
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def row_codes(self) -> list[RowCodes]:
        """Every state the layer holds as codes, each once."""
        held = list(self.__dict__.get("_coded", {}).values())
        held += [c for v in self.__dict__.values() if isinstance(v, _CodedDict) for c in v.held()]
        return list({id(c): c for c in held}.values())

    def tensors(self) -> list[torch.Tensor]:
        """The codes and exponents of every coded state, each once."""
        return [t for c in self.row_codes() for t in c.tensors]

    def cached_values(self) -> int:
        """Values the coded states stand for."""
        return sum(math.prod(c.shape) for c in self.row_codes())


@functools.cache
def _coded_class(kind: type) -> type:
    """``kind`` with the coded policy after it in the method order (its layout stays ``kind``'s,
    so an instance can change class: ``codes_own_states`` checked that nothing in ``kind``
    defines attribute access). Made with no ``_layer_type``, then given ``kind``'s: a layer
    class with one registers itself as transformers' layer of that type when made."""
    cls = type(f"Coded{kind.__name__}", (kind, _CodedStates),
               {"__module__": __name__, "__slots__": (), "_layer_type": None})
    cls._layer_type = kind._layer_type
    return cls


def coded(layer: DynamicLayer, spec: RowSpec) -> DynamicLayer:
    """``layer`` (a fresh layer of a model's own class: :func:`codes_own_states`), its states
    from now on stored as row codes of ``spec``: the same object, of a subclass of its class,
    so the model's ``isinstance`` checks and methods see what they saw before."""
    states, kind = dict(vars(layer)), type(layer)
    layer.__class__ = _coded_class(kind)
    object.__setattr__(layer, "_coder", _Coder(spec, kind.__name__))
    for name, value in states.items():
        setattr(layer, name, value)
    return layer


def is_coded(layer) -> bool:
    return isinstance(layer, _CodedStates)
