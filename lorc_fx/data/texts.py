"""Real English text for evaluation, found on this machine without network.

- ``"news"``: 300 ABC news articles (``lee_background.cor``, ~75k tokens) in the gensim wheel;
- ``"austen"``: Jane Austen's six novels (~1M tokens) from Debian's ``r-cran-janeaustenr``,
  read from its R lazy-load database;
- any UTF-8 text file.
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
    """Downloading or unpacking the janeaustenr package failed."""


def load_text(name: str) -> str:
    """``"news"``, ``"austen"`` or the path of a UTF-8 text file. Paragraphs (and articles,
    novels) are separated by blank lines."""
    if name == "news":
        return news_text()
    if name == "austen":
        return "\n\n".join(austen_novels().values())
    path = Path(name).expanduser()
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"text file {str(path)!r} is not UTF-8 text ({err.reason} at byte "
                             f"{err.start}); give a plain text file") from None
    raise TextNotFoundError(f"{name!r} is neither a known text (\"news\", \"austen\") nor a "
                            f"text file")


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


def _run(cmd: list[str], cwd: str) -> None:
    try:
        subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, text=True,
                       env={**os.environ, "LC_ALL": "C"})
    except FileNotFoundError as e:
        raise FetchError(f"`{cmd[0]}` not found: fetching {AUSTEN_PACKAGE} needs a Debian or "
                         f"Ubuntu system with apt-get and dpkg-deb") from e
    except subprocess.CalledProcessError as e:
        hint = (" (if apt cannot locate the package, run `sudo apt-get update` first)"
                if cmd[0] == "apt-get" else "")
        raise FetchError(f"`{' '.join(cmd)}` failed{hint}:\n{e.stderr.strip()}") from e


CHUNK_CHARS = 1000  # a text without blank lines is cut into paragraphs of about this size


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
