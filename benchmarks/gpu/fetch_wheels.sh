#!/usr/bin/env bash
# Download, here (with network), the wheels `run.sh` installs on the offline device machine:
# tokamax and those of its requirements the device image lacks (Python 3.12, x86-64).
# Keep .whl/ out of git: echo /.whl/ >> .git/info/exclude; then carry .whl to the device.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform any)
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plat[@]}" -d .whl tokamax==0.0.12 einshape qwix typeguard==2.13.3 immutabledict \
  tensorboardx pydantic pydantic-core annotated-types typing-inspection
