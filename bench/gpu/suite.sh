#!/usr/bin/env bash
# The GPU suite on the lent GPU machine, from the repository root there:
#     bash bench/gpu/suite.sh "$OUT" [bench/gpu/suite.py options]
# Installs the wheels carried in .whl/ (bench/gpu/prepare.sh) for this run only, then runs
# bench/gpu/suite.py with the machine's python3 (its torch, Triton and CUDA). bench/gpu/README.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:?give the results folder}
shift
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/lorc-site .whl/*.whl
    export PYTHONPATH=/tmp/lorc-site${PYTHONPATH:+:$PYTHONPATH}
fi
exec python3 bench/gpu/suite.py "$out" "$@"
