#!/usr/bin/env bash
# Download, here (with network), the wheels `run.sh` installs on the offline device machine
# (Python 3.12, x86-64, jax 0.11.2 in its image): tokamax and those of its import-time needs
# that the image lacks, each pinned, so the set installs together (pydantic 2.14.4 requires
# pydantic-core==2.50.5 and typing-extensions>=4.16). xprof is carried without its own
# requirements: tokamax imports only xprof.cli.tools (needs fire, termcolor; six, absl-py,
# protobuf are in the image). Then, when .venv-jax011 exists (make setup-gpu-lowering), the set
# is installed into a scratch folder the way run.sh does it and `import tokamax` plus one
# tokamax.ragged_dot are run against jax 0.11.2: a set that does not import fails here.
# .whl/ is in .gitignore; carry it to the device (the `carry` of the device tool).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
WHEELS=(tokamax==0.0.17 einshape==1.0 qwix==0.1.8 immutabledict==4.3.1 tensorboardx==2.6.5
        pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
        typing-extensions==4.16.0 xprof==2.24.2 fire==0.7.1 termcolor==3.3.0)
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
rm -rf .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plat[@]}" -d .whl "${WHEELS[@]}"
du -sh .whl
if [ -x .venv-jax011/bin/python ]; then
  site=$(mktemp -d)
  # the image's own packages that tokamax imports, for this check only (not carried)
  .venv-jax011/bin/python -m pip install -q --target "$site" absl-py jaxtyping tqdm protobuf six
  .venv-jax011/bin/python -m pip install -q --no-index --no-deps --no-compile --upgrade \
    --target "$site" .whl/*.whl
  PYTHONPATH="$site" .venv-jax011/bin/python -c '
import jax, jax.numpy as jnp, tokamax
out = tokamax.ragged_dot(jnp.ones((6, 4)), jnp.ones((3, 4, 8)), jnp.array([2, 0, 3]),
                         implementation="xla")
assert out[:, 0].tolist() == [4, 4, 4, 4, 4, 0], out
print(f"fetch_wheels: tokamax imports and runs with jax {jax.__version__} and these wheels")'
  rm -rf "$site"
else
  echo "fetch_wheels: no .venv-jax011 (make setup-gpu-lowering): the set was not import-checked"
fi
