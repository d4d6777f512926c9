#!/usr/bin/env bash
# Fills the wheel folders that the device batches carry (the device machine has torch, triton,
# transformers and their needs but no PyPI):
#
#   .whl/      LoongForge's own wheels and what they import that the device image lacks (not
#              tensorboard: 6 MB for an optional writer, whose absence a run notes in one line)
#   .whl-emb/  LeRobot 0.6.1 and what its PI05 policy and dataset modules import beyond the image
#   .whl-av/   PyAV (39 MB: carried only by the calls that decode video or import LeRobot)
#
# Versions are the workspace's lock file's. Run from the repository root; each folder stays under
# the 64 MiB a device call may carry (.whl/ + .whl-emb/ + .whl-av/ is about 56 MiB, and the working tree travels with them).
#   bash bench/device_wheels.sh           # all three folders
#   bash bench/device_wheels.sh own       # only rebuild LoongForge's wheels in .whl/ (after a code change)
set -euo pipefail
which=${1:-all}
case $which in all|own) ;; *) echo "error: unknown argument '$which' (all or own)" >&2; exit 2;; esac

version() {  # the locked version of a package
  python3 - "$1" <<'PY'
import sys, tomllib
name = sys.argv[1]
for p in tomllib.load(open("uv.lock", "rb"))["package"]:
    if p["name"] == name:
        print(p["version"]); break
else:
    sys.exit(f"error: uv.lock has no package {name!r}")
PY
}
download() {  # download DIR NAME... (each at its locked version, or NAME==VERSION as given)
  local dir=$1; shift
  local specs=()
  for name in "$@"; do
    case $name in *==*) specs+=("$name");; *) specs+=("$name==$(version "$name")");; esac
  done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform any -d "$dir" "${specs[@]}"
}

mkdir -p .whl
if [ "$which" = all ]; then
  rm -rf .whl .whl-emb .whl-av && mkdir -p .whl .whl-emb .whl-av
  # antlr4 4.9.3 (hydra's pin) is published as a source archive only: built here into a wheel
  python3 -m pip wheel -q --no-deps -w .whl "antlr4-python3-runtime==$(version antlr4-python3-runtime)"
  download .whl megatron-core omegaconf hydra-core diffusers \
      pytest pytest-xdist pytest-timeout execnet pluggy iniconfig liger-kernel==0.8.5
  download .whl-emb lerobot datasets draccus gymnasium dill multiprocess mergedeep pytz termcolor toml \
      farama-notifications googleapis-common-protos importlib-metadata typing-inspect mypy-extensions \
      xxhash zipp
  download .whl-av av
fi
rm -f .whl/loongforge_*.whl
for p in core llm kernels diffusion embodied vlm; do
  uv build -q --wheel --package "loongforge-$p" -o .whl
done
du -sh .whl .whl-emb .whl-av 2>/dev/null
