#!/usr/bin/env bash
# The two commands of the README:
#   ./dev.sh demo   the IMDS emulator plus the agent on loopback: a Reboot handled end to end
#   ./dev.sh test   the whole test suite (extra arguments go to pytest)
# Both create .venv and install maintd with its test and azure extras from PyPI on first use; `test`
# also installs Azurite (npm, into .azurite/) when node is there, for the Azure Storage backend's tests.
set -euo pipefail
cd "$(dirname "$0")"

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv || { echo "dev.sh: cannot create a venv; on Debian: apt-get install python3-venv" >&2; exit 1; }
fi
stamp=.venv/.maintd-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[test,lint,azure]"
    touch "$stamp"
fi

cmd=${1:-}
shift || true
case "$cmd" in
    demo) exec .venv/bin/maintd demo "$@" ;;
    test)
        if [ ! -x .azurite/node_modules/.bin/azurite-blob ] && command -v npm >/dev/null; then
            mkdir -p .azurite
            npm install --prefix .azurite --silent --no-audit --no-fund azurite@3 >/dev/null \
                || echo "dev.sh: npm could not install Azurite; the Azure Storage tests will say so" >&2
        fi
        exec .venv/bin/python -m pytest "$@" ;;
    *) echo "usage: ./dev.sh demo | test [pytest args]" >&2; exit 2 ;;
esac
