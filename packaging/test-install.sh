#!/usr/bin/env bash
# Install dist/maintd_*.deb with apt into a clean Debian 12 root (debootstrap) and run it there
# with Debian's own library versions: maintd --version, check-config of the shipped file, demo.
#   packaging/test-install.sh [ROOT]      (default /var/cache/maintd-ci/bookworm; reused if present)
# Needs root, debootstrap and deb.debian.org (a package registry); the root comes from debroot.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
deb=$(ls -t dist/maintd_*_all.deb | head -1)
. packaging/debroot.sh
debroot_make "${1:-}"
cp "$deb" "$root/tmp/"

echo "== apt-get install ./$(basename "$deb")"
in_root apt-get update -qq
in_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "/tmp/$(basename "$deb")" >/dev/null
echo "== Debian's library versions"
in_root dpkg-query -W python3 python3-requests python3-yaml python3-structlog python3-tenacity \
    python3-prometheus-client python3-dateutil
echo "== maintd --version"
in_root maintd --version
echo "== maintd check-config /etc/maintd/maintd.yaml"
in_root maintd check-config /etc/maintd/maintd.yaml
echo "== maintd check-config on every shipped example"
for example in "$root"/usr/share/doc/maintd/examples/*.yaml; do
    in_root maintd check-config "/usr/share/doc/maintd/examples/$(basename "$example")"
done
echo "== /etc/maintd/maintd.yaml is a conffile: a reinstall keeps the admin's edit"
in_root dpkg-query -W -f='${Conffiles}\n' maintd | grep -q '/etc/maintd/maintd.yaml'
echo "# edited by the admin" >> "$root/etc/maintd/maintd.yaml"
in_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --reinstall "/tmp/$(basename "$deb")" >/dev/null
grep -q "^# edited by the admin" "$root/etc/maintd/maintd.yaml"
echo "== no service was started (not under systemd here)"
if grep -qs "maintd.run" "$root"/proc/[0-9]*/cmdline; then echo "a maintd service was started" >&2; exit 1; fi
echo "== maintd demo"
in_root timeout 180 maintd demo
echo "== install test passed"
