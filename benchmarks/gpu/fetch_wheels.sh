#!/usr/bin/env bash
# Run HERE (where pip reaches PyPI), not on the GPU machine: downloads into .whl/ (git-ignored through
# .git/info/exclude) the wheels that jaxtune's benchmark path imports and that the lent GPU machine's image lacks,
# built for its Python 3.12 on x86-64, at the versions of this checkout's venv. The device tool carries .whl/ when a
# run names it in `carry`; run_all.sh installs it into /tmp/site. Extra requirements given as arguments are fetched
# too (e.g. `flax==0.12.8 optax==0.2.8` if the image's own flax does not work with jaxtune).
set -euo pipefail
cd "$(dirname "$0")/../.."
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF /.whl/ "$exclude" 2>/dev/null || echo /.whl/ >>"$exclude"
WANT=(
  pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
  grain==0.2.18 array-record==0.8.6 portpicker==1.6.0  # grain: jaxtune.train.step imports jaxtune.data
  torchax==0.0.13
  "$@"
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WANT[@]}"
ls -l .whl
du -sh .whl
