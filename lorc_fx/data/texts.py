"""Real text for calibration and evaluation, found on this machine without network.

- ``"news"``: 300 ABC news articles (``lee_background.cor``, ~75k tokens) in the gensim wheel;
- ``"austen"``: Jane Austen's six novels (~1M tokens) from Debian's ``r-cran-janeaustenr``,
  read from its R lazy-load database;
- ``"pydoc"``: technical documentation, the Python reference topics that ship with CPython
  (``pydoc_data/topics.py``, what ``help("assert")`` prints), one topic after another;
- ``"code"``: Python source, the top-level modules of the running interpreter's stdlib;
- ``"poems"``: verse, the ``songs-poems`` file of Debian's ``fortunes`` (~60k tokens), fetched
  like Austen (:func:`fetch_poems`);
- any UTF-8 text file.

The last three are genres the default calibration never saw, to check that a plan holds up
beyond the text it was measured on.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from .models import user_cache_dir
from .rdata import RVector, read_lazyload_db

NEWS_FILE = Path("test") / "test_data" / "lee_background.cor"
AUSTEN_PACKAGE = "r-cran-janeaustenr"
# janeaustenr's objects, in publication order
AUSTEN_NOVELS = {
    "sensesensibility": "Sense and Sensibility",
    "prideprejudice": "Pride and Prejudice",
    "mansfieldpark": "Mansfield Park",
    "emma": "Emma",
    "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
}
R_LIBRARIES = (Path("/usr/lib/R/site-library"), Path("/usr/local/lib/R/site-library"))
_PACKAGE_DATA = Path("janeaustenr") / "data"


class TextNotFoundError(FileNotFoundError):
    """The requested text is not on this machine; the message says how to get it."""


class FetchError(RuntimeError):
    """Downloading or unpacking a Debian package of text failed."""


def is_text(name: str) -> bool:
    """Whether ``name`` names a known text (:data:`TEXT_NAMES`) or an existing file: what
    :func:`load_text` reads, said without reading it."""
    return name in _TEXTS or Path(name).expanduser().is_file()


def load_text(name: str) -> str:
    """A known text (:data:`TEXT_NAMES`) or the path of a UTF-8 text file. Paragraphs (and
    articles, novels, topics, modules, poems) are separated by blank lines."""
    if name in _TEXTS:
        return _TEXTS[name]()
    path = Path(name).expanduser()
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"text file {str(path)!r} is not UTF-8 text ({err.reason} at byte "
                             f"{err.start}); give a plain text file") from None
    raise TextNotFoundError(f"{name!r} is neither a known text "
                            f"({', '.join(map(repr, TEXT_NAMES))}) nor a text file")


def news_text() -> str:
    """The ABC news articles (one per line in the file), separated by blank lines."""
    lines = news_path().read_text(encoding="utf-8").splitlines()
    return "\n\n".join(line.strip() for line in lines if line.strip())


def news_path() -> Path:
    """``lee_background.cor`` inside the installed gensim, found without importing gensim."""
    spec = importlib.util.find_spec("gensim")
    if spec is not None:
        for d in spec.submodule_search_locations or []:
            path = Path(d) / NEWS_FILE
            if path.is_file():
                return path
    raise TextNotFoundError("the news text (gensim's test/test_data/lee_background.cor) is not "
                            "installed; get it with `pip install --no-deps gensim`")


def austen_novels() -> dict[str, str]:
    """Title -> text of each novel, in publication order."""
    db = read_lazyload_db(austen_data_dir() / "Rdata")
    order = list(AUSTEN_NOVELS) + [k for k in db if k not in AUSTEN_NOVELS]
    return {AUSTEN_NOVELS.get(k, k): paragraphs(_text_lines(db[k])) for k in order if k in db}


def paragraphs(lines: list[str | None]) -> str:
    """Hard-wrapped lines -> one line per paragraph; blank lines separate paragraphs."""
    out, current = [], []
    for line in lines:
        line = (line or "").strip()
        if line:
            current.append(line)
        elif current:
            out.append(" ".join(current))
            current = []
    if current:
        out.append(" ".join(current))
    return "\n\n".join(out)


def _text_lines(obj) -> list[str | None]:
    """A novel's lines: a character vector, or a data frame's ``text`` column."""
    if isinstance(obj, RVector) and "data.frame" in obj.classes:
        obj = obj["text"]
    if not isinstance(obj, RVector) or obj.kind != "character":
        raise ValueError("janeaustenr data: expected a character vector or a data frame "
                         "with a text column")
    return obj.values


def austen_data_dir() -> Path:
    """janeaustenr's ``data/`` directory: installed by apt, or unpacked by ``fetch_austen``."""
    for root in (*R_LIBRARIES, _fetched_library()):
        data = root / _PACKAGE_DATA
        if (data / "Rdata.rdb").is_file() and (data / "Rdata.rdx").is_file():
            return data
    target = user_cache_dir() / "janeaustenr"
    raise TextNotFoundError(
        f"the Austen novels (Debian package {AUSTEN_PACKAGE}) are not on this machine; get "
        f"them with `lorc fetch-austen`, or `apt-get download {AUSTEN_PACKAGE} && dpkg-deb -x "
        f"{AUSTEN_PACKAGE}_*.deb {target}`, or `sudo apt-get install {AUSTEN_PACKAGE}`")


def _fetched_library() -> Path:
    return user_cache_dir() / "janeaustenr" / "usr" / "lib" / "R" / "site-library"


def fetch_austen() -> Path:
    """Download the janeaustenr .deb with apt-get and unpack it into the lorc cache
    (no root needed); returns its data directory. Unpacked in a temporary directory and
    renamed, so an interrupted fetch leaves nothing half-written."""
    target = user_cache_dir() / "janeaustenr"
    data = _fetched_library() / _PACKAGE_DATA
    if (data / "Rdata.rdb").is_file():
        return data
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".janeaustenr-", dir=target.parent) as tmp:
        _run(["apt-get", "download", AUSTEN_PACKAGE], cwd=tmp)
        debs = sorted(Path(tmp).glob(f"{AUSTEN_PACKAGE}_*.deb"))
        if not debs:
            raise FetchError(f"apt-get download left no {AUSTEN_PACKAGE}_*.deb in {tmp}")
        unpacked = Path(tmp) / "root"
        _run(["dpkg-deb", "-x", str(debs[-1]), str(unpacked)], cwd=tmp)
        if target.exists():
            shutil.rmtree(target)  # an older, incomplete unpack
        unpacked.rename(target)
    if not (data / "Rdata.rdb").is_file():
        raise FetchError(f"{AUSTEN_PACKAGE} unpacked into {target} but holds no {data}")
    return data


def _run(cmd: list[str], cwd: str, package: str = AUSTEN_PACKAGE) -> None:
    try:
        subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, text=True,
                       env={**os.environ, "LC_ALL": "C"})
    except FileNotFoundError as e:
        raise FetchError(f"`{cmd[0]}` not found: fetching {package} needs a Debian or "
                         f"Ubuntu system with apt-get and dpkg-deb") from e
    except subprocess.CalledProcessError as e:
        hint = (" (if apt cannot locate the package, run `sudo apt-get update` first)"
                if cmd[0] == "apt-get" else "")
        raise FetchError(f"`{' '.join(cmd)}` failed{hint}:\n{e.stderr.strip()}") from e


CHUNK_CHARS = 1000  # a text without blank lines is cut into paragraphs of about this size
HOLD_OUT = 4  # every HOLD_OUT-th paragraph is calibration's, the others evaluation's


def split_paragraphs(text: str) -> list[str]:
    """The text's paragraphs: blank-line separated, or, in a text without blank lines (a
    source file, a log, one long line), consecutive lines, else sentences, gathered into
    chunks of about ``CHUNK_CHARS`` characters, so that one paragraph is never the whole
    text (calibration keeps every fourth paragraph, evaluation the others)."""
    parts = [p for p in text.split("\n\n") if p.strip()]
    if len(parts) > 1:
        return parts
    pieces = [line for line in text.splitlines() if line.strip()]
    joiner = "\n"
    if len(pieces) <= 1:
        pieces = [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]
        joiner = " "
    chunks, current = [], []
    for piece in pieces:
        current.append(piece)
        if sum(len(p) + 1 for p in current) >= CHUNK_CHARS:
            chunks.append(joiner.join(current))
            current = []
    if current:
        chunks.append(joiner.join(current))
    return chunks


# --- texts of other genres: documentation, code, verse ------------------------------------

POEMS_PACKAGE = "fortunes"
POEMS_FILE = Path("usr") / "share" / "games" / "fortunes" / "songs-poems"
POEMS_ROOTS = (Path("/"),)  # where apt installs it; fetch_poems unpacks into the cache
STDLIB_CODE_CHARS = 600_000  # ~150k tokens of the stdlib's top-level modules


def _blocks(text: str) -> list[str]:
    """Blocks separated by blank lines, trailing spaces stripped, line breaks kept."""
    lines = [line.rstrip() for line in text.splitlines()]
    return [b.strip("\n") for b in "\n".join(lines).split("\n\n") if b.strip()]


def pydoc_text() -> str:
    """The reference topics of ``pydoc_data`` (shipped with CPython), sorted by name; blank
    lines separate paragraphs and the indented grammar and code blocks between them."""
    try:
        from pydoc_data.topics import topics
    except ImportError as err:  # some distributions package pydoc_data separately
        raise TextNotFoundError("this Python has no pydoc_data (the reference topics)") from err
    return "\n\n".join(b for name in sorted(topics) for b in _blocks(topics[name]))


def code_text() -> str:
    """Top-level public ``.py`` modules of the stdlib, sorted by name, until
    ``STDLIB_CODE_CHARS``; blank lines inside a module are dropped, so each paragraph is one
    whole module."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    out, size = [], 0
    for path in sorted(root.glob("*.py")):
        if path.name.startswith("_") or size >= STDLIB_CODE_CHARS:
            continue
        try:
            src = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        module = "\n".join(line.rstrip() for line in src.splitlines() if line.strip())
        out.append(module)
        size += len(module)
    if not out:
        raise TextNotFoundError(f"no stdlib sources under {root}")
    return "\n\n".join(out)


def poems_text() -> str:
    """Debian ``fortunes``' ``songs-poems``: one paragraph per poem (the entries between
    ``%`` lines), its line breaks kept and its stanza breaks made single line breaks."""
    raw = poems_path().read_text(encoding="utf-8", errors="replace")
    poems = []
    for entry in re.split(r"^%\s*$", raw, flags=re.M):
        lines = [line.strip() for line in entry.splitlines() if line.strip()]
        if lines:
            poems.append("\n".join(lines))
    return "\n\n".join(poems)


def poems_path() -> Path:
    """``songs-poems``: installed by apt, or unpacked by :func:`fetch_poems`."""
    for root in (*POEMS_ROOTS, user_cache_dir() / POEMS_PACKAGE):
        if (root / POEMS_FILE).is_file():
            return root / POEMS_FILE
    raise TextNotFoundError(
        f"the verse text (Debian package {POEMS_PACKAGE}, {POEMS_FILE.name}) is not on this "
        f"machine; get it with `lorc fetch-poems` or `sudo apt-get install {POEMS_PACKAGE}`")


def fetch_poems() -> Path:
    """Download the ``fortunes`` .deb with apt-get and unpack it into the lorc cache (no root
    needed); returns the path of ``songs-poems``. Unpacked in a temporary directory and
    renamed, like :func:`fetch_austen`."""
    target = user_cache_dir() / POEMS_PACKAGE
    if (target / POEMS_FILE).is_file():
        return target / POEMS_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{POEMS_PACKAGE}-", dir=target.parent) as tmp:
        _run(["apt-get", "download", POEMS_PACKAGE], cwd=tmp, package=POEMS_PACKAGE)
        debs = sorted(Path(tmp).glob(f"{POEMS_PACKAGE}_*.deb"))
        if not debs:
            raise FetchError(f"apt-get download left no {POEMS_PACKAGE}_*.deb in {tmp}")
        unpacked = Path(tmp) / "root"
        _run(["dpkg-deb", "-x", str(debs[-1]), str(unpacked)], cwd=tmp, package=POEMS_PACKAGE)
        if target.exists():
            shutil.rmtree(target)
        unpacked.rename(target)
    if not (target / POEMS_FILE).is_file():
        raise FetchError(f"{POEMS_PACKAGE} unpacked into {target} but holds no {POEMS_FILE}")
    return target / POEMS_FILE


_TEXTS = {
    "news": news_text,
    "austen": lambda: "\n\n".join(austen_novels().values()),
    "pydoc": pydoc_text,
    "code": code_text,
    "poems": poems_text,
}
TEXT_NAMES = tuple(_TEXTS)


def calibration_part(text: str) -> str:
    """The paragraphs reserved for calibration: every ``HOLD_OUT``-th, from the first."""
    return "\n\n".join(p for i, p in enumerate(split_paragraphs(text)) if i % HOLD_OUT == 0)


def evaluation_part(text: str) -> str:
    """Every paragraph calibration never reads."""
    return "\n\n".join(p for i, p in enumerate(split_paragraphs(text)) if i % HOLD_OUT != 0)
