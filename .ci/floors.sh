#!/usr/bin/env bash
# The dependency floors, tested: builds a venv with every dependency of
# pyproject.toml (and the test and tpu extras) pinned to its lower bound
# (`>=X` becomes `==X`), then runs the fast tests in it. Slow (a fresh
# jaxlib, TensorFlow and libtpu download, then the suite on CPU); not part
# of .ci/run. Run it after changing a lower bound:
#   bash .ci/floors.sh [VENV_DIR] [pytest arguments...]
# Default: /tmp/jaxformer-floors, `-m "not slow" tests`. The report, pip's
# resolved versions and pytest's summary, is printed and left in
# VENV_DIR/floors.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-/tmp/jaxformer-floors}
shift || true
tests=("$@")
[ ${#tests[@]} -gt 0 ] || tests=(-q -m "not slow" tests)

pins=$(python3 - <<'EOF'
import re, tomllib
project = tomllib.load(open('pyproject.toml', 'rb'))['project']
extras = project['optional-dependencies']
for spec in project['dependencies'] + extras['test'] + extras['tpu']:
  requirement, _, marker = spec.partition(';')
  name, op, version = re.match(r'\s*([^<>=!~ ]+)\s*(>=|==)?\s*([^,\s]*)',
                               requirement).groups()
  pinned = f'{name}=={version}' if op else name
  print(pinned + (f'; {marker.strip()}' if marker else ''))
EOF
)
echo "floors:"; echo "$pins" | sed 's/^/  /'

rm -rf "$venv"
python3 -m venv "$venv"
# This machine's pip constraints (if any) cap some packages; the floors are
# pinned exactly, so none applies.
export PIP_CONSTRAINT=
mapfile -t requirements <<< "$pins"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q "${requirements[@]}"
report="$venv/floors.txt"
{
  echo "python: $("$venv/bin/python" --version)"
  echo "floors:"; echo "$pins" | sed 's/^/  /'
  echo "resolved:"
  "$venv/bin/python" -m pip freeze | sed 's/^/  /'
} > "$report"
# The repository's own copy is imported (python -m puts the cwd first); the
# `jaxformer` command for the tests that run it comes from a plain install.
"$venv/bin/python" -m pip install -q --no-deps .
set +e
"$venv/bin/python" -m pytest -p no:cacheprovider "${tests[@]}" 2>&1 \
  | tee "$venv/pytest.txt"
status=${PIPESTATUS[0]}
set -e
echo "pytest ${tests[*]}: $(tail -1 "$venv/pytest.txt")" >> "$report"
cat "$report"
exit "$status"
