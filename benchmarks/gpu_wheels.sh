#!/usr/bin/env bash
# Wheels the lent GPU machine's image lacks (CUDA torch, transformers, peft, numba, pyarrow, torchvision are there;
# Energon's stack, LMDB and PyAV are not), for Python 3.12, into .gpuwheels/ (~45 MiB: carry it with the run).
# gpu_suite.sh installs them with --no-deps into a scratch folder on the GPU machine; nothing is fetched there.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpuwheels
pip download -q --no-deps --python-version 3.12 --only-binary=:all: -d .gpuwheels \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  megatron-energon==7.4.1 braceexpand filetype mfusepy multi-storage-client==1.3.1 rapidyaml webdataset \
  'wcmatch<11' bracex lark prettytable wcwidth xattr cffi pycparser jsonschema jsonschema-specifications referencing \
  rpds-py opentelemetry-api importlib-metadata jmespath pyroute2 lmdb av deprecation jsonpointer rfc3339-validator truststore
du -sh .gpuwheels
