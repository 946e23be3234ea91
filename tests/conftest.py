import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))  # the shared helpers package: `from helpers...`

import pytest  # noqa: E402
import torch  # noqa: E402

from helpers.tiny_llama import save_tiny_llama, write_text  # noqa: E402

torch.set_num_threads(1)


# The tiny Llama of ``helpers.tiny_llama``, saved once per session, loaded per test with its
# own cache directory (calibration and sampled text are cached per test, never shared).
@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    text = write_text(root / "text.txt")
    return save_tiny_llama(root / "model"), text


@pytest.fixture
def loaded(tiny, tmp_path, monkeypatch):
    from lorc_fx.analysis import analyze
    from lorc_fx.data.models import load_model, load_tokenizer

    monkeypatch.setenv("LORC_CACHE_DIR", str(tmp_path / "cache"))
    directory, text = tiny
    model = load_model(directory)
    return model, load_tokenizer(directory), analyze(model), text
