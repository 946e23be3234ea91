"""A small reader of R's serialization format (XDR, versions 2 and 3) and lazy-load databases.

Enough for data packages: vectors, lists, data frames, pairlists, symbols, strings and the
compact / wrapper ALTREP forms; closures, environments and byte code are refused.
Format: R's ``src/main/serialize.c``; a lazy-load database is ``NAME.rdx`` (a serialized index of
``(offset, length)`` per object) plus ``NAME.rdb`` (one compressed serialization per object).
"""
from __future__ import annotations

import bz2
import lzma
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NA_INTEGER = -(2 ** 31)

# SEXP types (the low byte of an item's flags)
NILSXP, SYMSXP, LISTSXP = 0, 1, 2
CHARSXP, LGLSXP, INTSXP, REALSXP, STRSXP, VECSXP, EXPRSXP = 9, 10, 13, 14, 16, 19, 20
ALTREP_SXP, REFSXP, NILVALUE_SXP = 238, 255, 254

_VECTOR_KINDS = {LGLSXP: "logical", INTSXP: "integer", REALSXP: "double",
                 STRSXP: "character", VECSXP: "list", EXPRSXP: "expression"}
# CHARSXP encoding bits, in the flags' "levels" field
_LATIN1, _UTF8, _BYTES, _ASCII = 1 << 2, 1 << 3, 1 << 1, 1 << 6


class RDataError(ValueError):
    """The bytes are not an R serialization this reader understands."""


@dataclass(frozen=True)
class RSymbol:
    name: str


@dataclass
class RVector:
    """An R vector or pairlist: ``kind`` is R's ``typeof`` ("character", "list", "pairlist"...);
    NA is ``None`` except in doubles, where it stays a NaN."""

    kind: str
    values: list
    attributes: dict[str, Any] = field(default_factory=dict)

    @property
    def names(self) -> list[str] | None:
        names = self.attributes.get("names")
        return names.values if names is not None else None

    @property
    def classes(self) -> list[str]:
        cls = self.attributes.get("class")
        return cls.values if cls is not None else []

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, name: str):
        """The element called ``name`` (a data frame's column, a named list's entry)."""
        names = self.names or []
        if name not in names:
            raise KeyError(name)
        return self.values[names.index(name)]


def unserialize(data: bytes) -> Any:
    """The R object serialized in ``data``, compressed (gzip, zlib, bzip2, xz) or not."""
    return _Reader(_decompress(data)).read_stream()


def read_rds(path: str | Path) -> Any:
    """The object saved by ``saveRDS`` at ``path``."""
    return unserialize(Path(path).read_bytes())


def read_lazyload_db(prefix: str | Path) -> dict[str, Any]:
    """Every object of the lazy-load database ``prefix.rdx`` / ``prefix.rdb``, by name, in
    the database's order (e.g. ``read_lazyload_db(".../janeaustenr/data/Rdata")``)."""
    index = read_rds(f"{prefix}.rdx")
    compression = index["compressed"].values[0]
    variables = index["variables"]
    db = Path(f"{prefix}.rdb").read_bytes()
    objects = {}
    for name, where in zip(variables.names, variables.values):
        offset, length = (int(v) for v in where.values)
        block = _decompress_block(db[offset:offset + length], compression)
        objects[name] = _Reader(block).read_stream()
    return objects


def _decompress(data: bytes) -> bytes:
    if data[:2] == b"\x1f\x8b" or data[:1] == b"\x78":
        return zlib.decompress(data, 47)  # 32 + 15: gzip or zlib header
    if data[:3] == b"BZh":
        return bz2.decompress(data)
    if data[:6] == b"\xfd7zXZ\x00":
        return lzma.decompress(data)
    return data


def _decompress_block(block: bytes, compression) -> bytes:
    """One ``.rdb`` entry: the bare serialization if the database is uncompressed, else a
    4-byte big-endian raw length, [a type byte for bzip2 / xz databases], then the
    compressed serialization."""
    if not compression:
        return block
    (size,) = struct.unpack(">I", block[:4])
    if compression in (True, 1):
        out = zlib.decompress(block[4:])
    else:
        kind, payload = block[4:5], block[5:]
        decoders = {b"0": bytes, b"1": zlib.decompress, b"2": bz2.decompress,
                    b"Z": lzma.decompress}
        if kind not in decoders:
            raise RDataError(f"unknown lazy-load block compression {kind!r}")
        out = decoders[kind](payload)
    if len(out) != size:
        raise RDataError(f"lazy-load block: expected {size} bytes, got {len(out)}")
    return out


class _Reader:
    """One XDR serialization stream (``R_Unserialize``)."""

    def __init__(self, data: bytes):
        self.data = data
        self.pos = 0
        self.refs: list[Any] = []
        self.native_encoding = "utf-8"

    def read_stream(self) -> Any:
        if self.data[:2] != b"X\n":
            raise RDataError(f"not an XDR R serialization (starts {self.data[:2]!r}); "
                             "ASCII and native binary formats are not supported")
        self.pos = 2
        version, _writer, _min_reader = self._ints(3)
        if version == 3:
            self.native_encoding = self._bytes(self._int()).decode("ascii")
        elif version != 2:
            raise RDataError(f"serialization version {version} (only 2 and 3 are known)")
        return self._item()

    def _int(self) -> int:
        (value,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return value

    def _ints(self, n: int) -> tuple[int, ...]:
        values = struct.unpack_from(f">{n}i", self.data, self.pos)
        self.pos += 4 * n
        return values

    def _doubles(self, n: int) -> tuple[float, ...]:
        values = struct.unpack_from(f">{n}d", self.data, self.pos)
        self.pos += 8 * n
        return values

    def _bytes(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise RDataError("truncated serialization")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def _length(self) -> int:
        n = self._int()
        if n == -1:  # long vector: two more words
            hi, lo = self._ints(2)
            n = (hi << 32) + lo
        return n

    def _item(self) -> Any:
        flags = self._int()
        sexp, levels = flags & 0xFF, flags >> 12
        has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if sexp in (NILVALUE_SXP, NILSXP):
            return None
        if sexp == REFSXP:
            index = flags >> 8 or self._int()
            return self.refs[index - 1]
        if sexp == SYMSXP:
            symbol = RSymbol(self._item())
            self.refs.append(symbol)
            return symbol
        if sexp == LISTSXP:
            return self._pairlist(has_attr, has_tag)
        if sexp == CHARSXP:
            return self._charsxp(levels)
        if sexp == ALTREP_SXP:
            return self._altrep()
        if sexp in _VECTOR_KINDS:
            vector = RVector(_VECTOR_KINDS[sexp], self._vector_values(sexp))
            if has_attr:
                vector.attributes = self._attributes(self._item())
            return vector
        raise RDataError(f"R object type {sexp} is not supported (only data: vectors, lists, "
                         "pairlists, symbols)")

    def _pairlist(self, has_attr: bool, has_tag: bool) -> RVector:
        """A pairlist, read iteratively along its CDR chain; the tail of a dotted pair
        (a last CDR other than NULL) becomes the last, untagged element."""
        out = RVector("pairlist", [])
        tags = []
        while True:
            if has_attr:
                attributes = self._item()
                if not out.values:
                    out.attributes = self._attributes(attributes)
            tag = self._item() if has_tag else None
            tags.append(tag.name if isinstance(tag, RSymbol) else "")
            out.values.append(self._item())
            flags = self._int()
            if flags & 0xFF != LISTSXP:
                self.pos -= 4
                tail = self._item()
                if tail is not None:
                    out.values.append(tail)
                    tags.append("")
                break
            has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if any(tags):
            out.attributes["names"] = RVector("character", tags)
        return out

    def _attributes(self, pairlist: RVector | None) -> dict[str, Any]:
        if pairlist is None:
            return {}
        return dict(zip(pairlist.names or [], pairlist.values))

    def _charsxp(self, levels: int) -> str | None:
        n = self._int()
        if n == -1:
            return None  # NA_STRING
        raw = self._bytes(n)
        if levels & _LATIN1 or levels & _BYTES:
            return raw.decode("latin-1")
        if levels & (_UTF8 | _ASCII):
            return raw.decode("utf-8")
        return raw.decode(self.native_encoding)

    def _vector_values(self, sexp: int) -> list:
        n = self._length()
        if sexp in (STRSXP, VECSXP, EXPRSXP):
            return [self._item() for _ in range(n)]
        if sexp == REALSXP:
            return list(self._doubles(n))
        ints = self._ints(n)
        if sexp == LGLSXP:
            return [None if v == NA_INTEGER else bool(v) for v in ints]
        return [None if v == NA_INTEGER else v for v in ints]

    def _altrep(self) -> RVector:
        """Compact sequences and wrappers, expanded to ordinary vectors."""
        info, state, attributes = self._item(), self._item(), self._item()
        cls = info.values[0].name
        if cls in ("compact_intseq", "compact_realseq"):
            n, start, step = state.values
            values = [start + step * i for i in range(int(n))]
            if cls == "compact_intseq":
                vector = RVector("integer", [int(v) for v in values])
            else:
                vector = RVector("double", [float(v) for v in values])
        elif cls.startswith("wrap_"):
            vector = state.values[0]
        else:
            raise RDataError(f"ALTREP class {cls!r} is not supported")
        if attributes is not None:
            vector.attributes = self._attributes(attributes)
        return vector
