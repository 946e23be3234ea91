import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))  # the shared helpers package: `from helpers...`

import torch  # noqa: E402

torch.set_num_threads(1)
