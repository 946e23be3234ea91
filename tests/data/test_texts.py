"""Text loading and the R serialization reader, on hand-built R data and the real texts."""
from __future__ import annotations

import bz2
import gzip
import importlib.util
import lzma
import os
import shutil
import struct
import subprocess
import zlib

import pytest

from lorc_fx.data import texts
from lorc_fx.data.rdata import RDataError, RSymbol, read_lazyload_db, unserialize
from lorc_fx.data.texts import FetchError, TextNotFoundError, load_text

NA_INT = -(2 ** 31)
UTF8, LATIN1, ASCII = 1 << 3, 1 << 2, 1 << 6


class XdrWriter:
    """A tiny R serializer (XDR), enough to build test objects; symbols become references
    after their first use, as R writes them."""

    def __init__(self):
        self.symbols: dict[str, int] = {}

    @staticmethod
    def ints(*values: int) -> bytes:
        return struct.pack(f">{len(values)}i", *values)

    def flags(self, sexp, obj=False, attr=False, tag=False, levels=0) -> bytes:
        return self.ints(sexp | obj << 8 | attr << 9 | tag << 10 | levels << 12)

    def header(self, version=3) -> bytes:
        out = b"X\n" + self.ints(version, 0x040201, 0x030500)
        return out + self.ints(5) + b"UTF-8" if version == 3 else out

    def nil(self) -> bytes:
        return self.ints(254)

    def char(self, s, levels=UTF8, encoding="utf-8") -> bytes:
        if s is None:
            return self.flags(9) + self.ints(-1)
        raw = s.encode(encoding)
        return self.flags(9, levels=levels) + self.ints(len(raw)) + raw

    def sym(self, name) -> bytes:
        if name in self.symbols:
            return self.ints(self.symbols[name] << 8 | 255)
        self.symbols[name] = len(self.symbols) + 1
        return self.flags(1) + self.char(name, ASCII)

    def attrs(self, attributes) -> bytes:
        return self.pairlist(attributes) if attributes else b""

    def pairlist(self, items: dict) -> bytes:
        out = b"".join(self.flags(2, tag=True) + self.sym(k) + v for k, v in items.items())
        return out + self.nil()

    def untagged(self, *items: bytes) -> bytes:
        return b"".join(self.flags(2) + v for v in items) + self.nil()

    def strs(self, values, attributes=None, obj=False) -> bytes:
        body = b"".join(self.char(v) if v is None or isinstance(v, str) else v for v in values)
        return (self.flags(16, obj, bool(attributes)) + self.ints(len(values)) + body
                + self.attrs(attributes))

    def int_vec(self, values, attributes=None, sexp=13) -> bytes:
        return (self.flags(sexp, attr=bool(attributes)) + self.ints(len(values), *values)
                + self.attrs(attributes))

    def reals(self, values) -> bytes:
        return self.flags(14) + self.ints(len(values)) + struct.pack(f">{len(values)}d", *values)

    def vec(self, items, attributes=None, obj=False) -> bytes:
        return (self.flags(19, obj, bool(attributes)) + self.ints(len(items)) + b"".join(items)
                + self.attrs(attributes))

    def data_frame(self, columns: dict[str, list[str]]) -> bytes:
        n = len(next(iter(columns.values())))
        return self.vec([self.strs(v) for v in columns.values()], {
            "names": self.strs(list(columns)),
            "class": self.strs(["data.frame"]),
            "row.names": self.int_vec([NA_INT, -n]),
        }, obj=True)


def serialize(build, version=3) -> bytes:
    w = XdrWriter()
    return w.header(version) + build(w)


def write_lazyload_db(prefix, objects: dict[str, bytes], compression=1):
    """R's makeLazyLoadDB layout: blocks in .rdb, a gzipped index in .rdx."""
    rdb, where = b"", {}
    for name, data in objects.items():
        if compression == 0:
            block = data
        elif compression == 1:
            block = struct.pack(">I", len(data)) + zlib.compress(data)
        else:
            block = struct.pack(">I", len(data)) + b"Z" + lzma.compress(data)
        where[name] = (len(rdb), len(block))
        rdb += block

    def index(w):
        variables = w.vec([w.int_vec(list(v)) for v in where.values()],
                          {"names": w.strs(list(where))})
        references = w.vec([], {"names": w.strs([])})
        compressed = w.int_vec([compression], sexp=10 if compression < 2 else 13)
        return w.vec([variables, references, compressed],
                     {"names": w.strs(["variables", "references", "compressed"])})

    prefix.with_suffix(".rdb").write_bytes(rdb)
    prefix.with_suffix(".rdx").write_bytes(gzip.compress(serialize(index)))


# --- the R reader -------------------------------------------------------------------------

@pytest.mark.parametrize("version", [2, 3])
def test_reads_data_frame_and_vectors(version):
    def build(w):
        return w.vec([
            w.data_frame({"text": ["a line", "", None], "book": ["Emma", "Emma", "Emma"]}),
            w.strs([w.char("café", LATIN1, "latin-1"), w.char("naïve"), w.char("plain", ASCII),
                    None]),
            w.int_vec([1, NA_INT, -7]),
            w.int_vec([1, 0, NA_INT], sexp=10),
            w.reals([1.5, -2.0]),
        ], {"names": w.strs(["df", "s", "i", "l", "r"])})

    obj = unserialize(serialize(build, version))
    assert obj.kind == "list" and obj.names == ["df", "s", "i", "l", "r"]
    df = obj["df"]
    assert df.classes == ["data.frame"] and df.names == ["text", "book"]
    assert df["text"].values == ["a line", "", None]
    assert df.attributes["row.names"].values == [None, -3]
    assert obj["s"].values == ["café", "naïve", "plain", None]
    assert obj["i"].values == [1, None, -7]
    assert obj["l"].values == [True, False, None]
    assert obj["r"].values == [1.5, -2.0]


def test_symbols_are_shared_through_references():
    def build(w):
        inner = w.vec([w.strs(["x"])], {"names": w.strs(["a"])})
        return w.vec([inner, w.strs(["y"])], {"names": w.strs(["b", "c"])})

    data = serialize(build)
    assert data.count(b"names") == 1  # second use is a REFSXP
    obj = unserialize(data)
    assert obj.names == ["b", "c"] and obj["b"].names == ["a"]


def test_pairlists_keep_tags_and_symbols():
    obj = unserialize(serialize(lambda w: w.pairlist({"x": w.sym("foo"), "y": w.nil()})))
    assert obj.kind == "pairlist" and obj.names == ["x", "y"]
    assert obj.values == [RSymbol("foo"), None]


def test_altrep_compact_sequence_and_wrapper():
    def build(w):
        seq = (w.ints(238) + w.untagged(w.sym("compact_intseq"), w.sym("base"), w.int_vec([13]))
               + w.reals([4.0, 10.0, 1.0]) + w.nil())
        wrapped_state = w.flags(2) + w.strs(["p", "q"]) + w.int_vec([0, 0])  # dotted pair
        wrapped = (w.ints(238) + w.untagged(w.sym("wrap_string"), w.sym("base"), w.int_vec([16]))
                   + wrapped_state + w.pairlist({"names": w.strs(["m", "n"])}))
        return w.vec([seq, wrapped])

    seq, wrapped = unserialize(serialize(build)).values
    assert seq.kind == "integer" and seq.values == [10, 11, 12, 13]
    assert wrapped.values == ["p", "q"] and wrapped.names == ["m", "n"]


@pytest.mark.parametrize("compress", [gzip.compress, zlib.compress, bz2.compress,
                                      lzma.compress, lambda b: b])
def test_compressed_streams(compress):
    assert unserialize(compress(serialize(lambda w: w.strs(["ok"])))).values == ["ok"]


def test_refuses_what_it_cannot_read():
    with pytest.raises(RDataError, match="not an XDR"):
        unserialize(b"A\n1\n")
    with pytest.raises(RDataError, match="type 3"):
        unserialize(serialize(lambda w: w.flags(3)))  # a closure


@pytest.mark.parametrize("compression", [0, 1, 3])
def test_lazyload_db(tmp_path, compression):
    write_lazyload_db(tmp_path / "Rdata", {
        "emma": serialize(lambda w: w.strs(["EMMA", "", "Emma Woodhouse"])),
        "df": serialize(lambda w: w.data_frame({"text": ["x"]})),
    }, compression)
    db = read_lazyload_db(tmp_path / "Rdata")
    assert list(db) == ["emma", "df"]
    assert db["emma"].values == ["EMMA", "", "Emma Woodhouse"]
    assert db["df"]["text"].values == ["x"]


# --- load_text ------------------------------------------------------------------------------

def fake_janeaustenr(library):
    """A janeaustenr data directory with two 'novels' (one as a data frame), in R's
    alphabetical database order."""
    data = library / "janeaustenr" / "data"
    data.mkdir(parents=True)
    write_lazyload_db(data / "Rdata", {
        "emma": serialize(lambda w: w.data_frame({
            "text": ["EMMA", "", "Emma Woodhouse, handsome, clever,", "and rich."],
            "book": ["Emma"] * 4})),
        "prideprejudice": serialize(lambda w: w.strs([
            "PRIDE AND PREJUDICE", "", "", "It is a truth universally", "  acknowledged,",
            "", "Mr. Bennet."])),
    })
    return data


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LORC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(texts, "R_LIBRARIES", ())
    monkeypatch.setattr(texts, "POEMS_ROOTS", ())
    return tmp_path / "cache"


def test_austen_from_installed_package(tmp_path, cache, monkeypatch):
    fake_janeaustenr(tmp_path / "site-library")
    monkeypatch.setattr(texts, "R_LIBRARIES", (tmp_path / "site-library",))
    novels = texts.austen_novels()
    assert list(novels) == ["Pride and Prejudice", "Emma"]  # publication order
    assert novels["Pride and Prejudice"] == (
        "PRIDE AND PREJUDICE\n\nIt is a truth universally acknowledged,\n\nMr. Bennet.")
    assert load_text("austen") == "\n\n".join(novels.values())


def test_austen_absent_says_how_to_get_it(cache):
    with pytest.raises(TextNotFoundError) as e:
        load_text("austen")
    assert isinstance(e.value, FileNotFoundError)
    for hint in ("lorc fetch-austen", "apt-get download r-cran-janeaustenr", "dpkg-deb -x",
                 str(cache / "janeaustenr")):
        assert hint in str(e.value)


def fake_apt_get(bin_dir, script):
    bin_dir.mkdir(exist_ok=True)
    apt = bin_dir / "apt-get"
    apt.write_text("#!/bin/sh\n" + script)
    apt.chmod(0o755)


def serve_deb(tmp_path, root, package: str, version: str, monkeypatch) -> None:
    """Build ``root`` into a .deb of ``package`` ``version`` and put on PATH a fake apt-get
    whose ``download`` drops it where apt would (epoch left out of the file name)."""
    (root / "DEBIAN").mkdir()
    (root / "DEBIAN" / "control").write_text(
        f"Package: {package}\nVersion: {version}\nArchitecture: all\n"
        "Maintainer: test <t@example.org>\nDescription: test\n")
    deb = tmp_path / "fake.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(root), str(deb)],
                   check=True, capture_output=True)
    fake_apt_get(tmp_path / "bin", f"cp {deb} ./{package}_{version.split(':')[-1]}_all.deb\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb")
def test_fetch_austen_unpacks_into_cache(tmp_path, cache, monkeypatch):
    root = tmp_path / "pkg"
    fake_janeaustenr(root / "usr" / "lib" / "R" / "site-library")
    serve_deb(tmp_path, root, "r-cran-janeaustenr", "1.0.0-1", monkeypatch)

    data = texts.fetch_austen()
    assert data.is_relative_to(cache) and (data / "Rdata.rdb").is_file()
    assert [p.name for p in cache.iterdir()] == ["janeaustenr"]  # no temporary leftovers
    assert "It is a truth universally acknowledged" in load_text("austen")
    (tmp_path / "bin" / "apt-get").unlink()
    assert texts.fetch_austen() == data  # already there: no download


def test_fetch_austen_failure_is_explained(tmp_path, cache, monkeypatch):
    fake_apt_get(tmp_path / "bin",
                 "echo 'E: Unable to locate package r-cran-janeaustenr' >&2; exit 100\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    with pytest.raises(FetchError, match="apt-get update") as e:
        texts.fetch_austen()
    assert "Unable to locate package" in str(e.value)
    assert not (cache / "janeaustenr").exists()


def test_news_absent_says_how_to_get_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gensim" else real(name, *a))
    with pytest.raises(TextNotFoundError, match="pip install --no-deps gensim"):
        load_text("news")


def test_text_file_and_bad_name(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("Ünïcode text\n", encoding="utf-8")
    assert load_text(str(path)) == "Ünïcode text\n"
    with pytest.raises(TextNotFoundError, match="neither a known text") as e:
        load_text(str(tmp_path / "missing.txt"))
    assert all(repr(name) in str(e.value) for name in texts.TEXT_NAMES)


# --- texts of other genres ------------------------------------------------------------------

@pytest.mark.parametrize("name", ["pydoc", "code"])
def test_stdlib_texts_ship_with_python_and_split_into_paragraphs(name):
    from lorc_fx.data.texts import calibration_part, evaluation_part

    text = load_text(name)
    paragraphs = text.split("\n\n")
    assert len(paragraphs) >= 20 and len(text) > 200_000
    assert all(p.strip() and p == p.rstrip() for p in paragraphs)
    assert any(line.startswith("    ") for line in text.splitlines())  # indentation kept
    assert calibration_part(text) and evaluation_part(text)


def fake_fortunes(root, poems):
    path = root / texts.POEMS_FILE
    path.parent.mkdir(parents=True)
    path.write_text("\n%\n".join(poems) + "\n%\n")


def test_poems_are_one_paragraph_each_with_their_line_breaks(tmp_path, cache, monkeypatch):
    fake_fortunes(tmp_path / "root", ["Roses are red,\n  violets blue.\n\nSecond stanza.",
                                      "\nOne line only.\n"])
    monkeypatch.setattr(texts, "POEMS_ROOTS", (tmp_path / "root",))  # as apt installs it
    assert load_text("poems") == ("Roses are red,\nviolets blue.\nSecond stanza."
                                  "\n\nOne line only.")


def test_poems_absent_say_how_to_get_them(cache):
    with pytest.raises(TextNotFoundError, match="lorc fetch-poems"):
        load_text("poems")


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb")
def test_fetch_poems_unpacks_into_cache(tmp_path, cache, monkeypatch):
    root = tmp_path / "pkg"
    fake_fortunes(root, ["A short poem,\nin two lines."])
    serve_deb(tmp_path, root, "fortunes", "1:1.99.1-7", monkeypatch)

    path = texts.fetch_poems()
    assert path.is_relative_to(cache) and path.read_text().startswith("A short poem")
    assert [p.name for p in cache.iterdir()] == ["fortunes"]  # no temporary leftovers
    (tmp_path / "bin" / "apt-get").unlink()
    assert texts.fetch_poems() == path  # already there: no download


# --- the real texts, when installed ---------------------------------------------------------

def test_real_news():
    if importlib.util.find_spec("gensim") is None:
        pytest.skip("gensim not installed (pip install --no-deps gensim)")
    text = load_text("news")
    assert len(text.split("\n\n")) == 300
    assert text.startswith("Hundreds of people have been forced to vacate their homes")


def test_real_austen():
    try:
        texts.austen_data_dir()
    except TextNotFoundError:
        pytest.skip("r-cran-janeaustenr not fetched (lorc fetch-austen)")
    novels = texts.austen_novels()
    assert list(novels) == list(texts.AUSTEN_NOVELS.values())
    assert "It is a truth universally acknowledged, that a single man in possession of a good " \
           "fortune, must be in want of a wife." in novels["Pride and Prejudice"]
    assert "Emma Woodhouse, handsome, clever, and rich" in novels["Emma"]
    text = load_text("austen")
    assert 3_500_000 < len(text) < 4_500_000


def test_a_text_without_blank_lines_is_split_into_paragraphs():
    from lorc_fx.data.texts import CHUNK_CHARS, split_paragraphs

    lines = [f"line {i} of a source file without blank lines" for i in range(400)]
    chunks = split_paragraphs("\n".join(lines))
    assert len(chunks) > 8 and "\n".join(chunks) == "\n".join(lines)
    assert all(len(c) >= CHUNK_CHARS for c in chunks[:-1])
    sentences = " ".join(f"Sentence number {i} ends here." for i in range(300))
    chunks = split_paragraphs(sentences)
    assert len(chunks) > 4 and " ".join(chunks) == sentences
    assert split_paragraphs("one\n\ntwo\n\n\n\nthree") == ["one", "two", "three"]


def test_a_binary_text_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ValueError, match="weights.bin.*is not UTF-8 text"):
        load_text(str(path))


def test_real_poems():
    try:
        text = load_text("poems")
    except TextNotFoundError as err:
        assert "fetch-poems" in str(err)
        pytest.skip("fortunes not fetched (lorc fetch-poems)")
    poems = text.split("\n\n")
    assert len(poems) > 500 and sum("\n" in p for p in poems) > 0.9 * len(poems)
