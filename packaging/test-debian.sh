#!/usr/bin/env bash
# The unit and fault tests on Debian 12's own libraries, the oldest maintd supports (pyproject.toml's
# lower bounds and the .deb's Depends are these versions):
#   packaging/test-debian.sh [PYTEST ARGS]     (default: tests, without e2e/ and the package tests; ARGS replace that)
# In a fresh copy of the cached bookworm root (debroot.sh), dist/maintd_*.deb is installed and removed
# again, which leaves exactly the libraries it Depends on; Debian's python3-pytest, python3-hypothesis
# and python3-responses are added, and Debian's pytest runs on a copy of this tree. Needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
deb=$(ls -t dist/maintd_*_all.deb | head -1)
. packaging/debroot.sh
debroot_make "${MAINTD_DEBROOT:-}"
cp "$deb" "$root/tmp/"
mkdir "$root/src"
git ls-files -z --cached --others --exclude-standard \
    | xargs -0 cp --parents -t "$root/src"

echo "== Debian's libraries the .deb depends on, and Debian's test tools"
in_root apt-get update -qq
in_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "/tmp/$(basename "$deb")" \
    python3-pytest python3-hypothesis python3-responses >/dev/null
in_root env DEBIAN_FRONTEND=noninteractive apt-get remove -y -qq maintd >/dev/null
in_root dpkg-query -W python3 python3-requests python3-yaml python3-structlog python3-tenacity \
    python3-prometheus-client python3-dateutil python3-pytest python3-hypothesis python3-responses
echo "== pytest on Debian 12"
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(tests --ignore=tests/e2e -m "not package and not lint")
chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
    MAINTD_DEBIAN_ROOT=1 sh -c 'cd /src && exec python3 -m pytest -p no:cacheprovider "$@"' pytest "${args[@]}"
