#!/usr/bin/env bash
# The serving stack's wheels (FastAPI, uvicorn, httpx, llguidance and what they need: 7 MB) for the GPU
# machine's Python, put in .whl/ beside fla's, so that `source .devcache/env.sh` installs them there: the GPU
# image has torch, triton and transformers but no server, and cannot reach a package index. Without them every
# server part of bench/serve_gpu.sh stops at its first import. The openai client is left out (3 MB that
# bench/serve.py does not use; it speaks HTTP through httpx), keeping the tree sent to the GPU machine small.
#
#   bash bench/gpu_wheels.sh [PYTHON_VERSION]      # on this machine, from the repository root; default 3.12
set -eu
version=${1:-3.12}
top=$(git rev-parse --show-toplevel)
mkdir -p "$top/.whl"
platforms=()
for tag in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64; do
  platforms+=(--platform "$tag")
done
python3 -m pip download -q --only-binary=:all: --python-version "$version" --implementation cp "${platforms[@]}" \
  -d "$top/.whl" fastapi uvicorn httpx "llguidance>=1.0"
ls "$top/.whl" | sed 's/^/  /'
du -sh "$top/.whl"
