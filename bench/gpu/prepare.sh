#!/usr/bin/env bash
# Before the GPU call, here (it needs the package index): the wheels the GPU machine lacks, into
# .whl/ (kept out of git by .git/info/exclude), which the call carries and bench/gpu/suite.sh
# installs there for the run. Today: transformers at the project's pin (the machine's image has
# an older one). Its other needs are on the image; the default model's wheel (94 MB) is over
# what a call carries, so the suite times a random model of its shape instead.
set -euo pipefail
cd "$(dirname "$0")/../.."
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
pin=$(grep -o '"transformers==[^"]*"' pyproject.toml | tr -d '"')
rm -rf .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 -d .whl "$pin"
ls -l .whl
