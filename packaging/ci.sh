#!/usr/bin/env bash
# Everything CI checks for what ships: the systemd units, the shipped configs, the alert rules,
# the .deb/.rpm build, and the .deb installed with apt into a clean Debian 12 root.
#   packaging/ci.sh          (root; Debian 12 host; network: the package registries only)
# Idempotent: tools are installed once, the debootstrapped root is cached under
# /var/cache/maintd-ci, nfpm stays in build/tools, so a second run takes well under a minute.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive

section() { printf '\n===== %s =====\n' "$*"; }

section "tools: debootstrap, promtool (prometheus), systemd-analyze (systemd), python3-venv"
need=()
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v promtool >/dev/null || need+=(prometheus)
command -v systemd-analyze >/dev/null || need+=(systemd)
python3 -c 'import ensurepip, venv' 2>/dev/null || need+=(python3-venv)
if [ ${#need[@]} -gt 0 ]; then
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
echo "ok"

section "systemd-analyze verify systemd/maintd.service systemd/maintd.socket"
# verify wants ExecStart= to exist: check a copy pointing at this checkout's python.
units=$(mktemp -d)
trap 'rm -rf "$units"' EXIT
printf '#!/bin/sh\nexec python3 -m agent "$@"\n' > "$units/maintd" && chmod 755 "$units/maintd"
sed "s#/usr/bin/maintd#$units/maintd#" systemd/maintd.service > "$units/maintd.service"
cp systemd/maintd.socket "$units/"
systemd-analyze verify "$units/maintd.service" "$units/maintd.socket"
systemd-analyze security --offline=true "$units/maintd.service" | tail -1

section "promtool check rules / test rules"
(cd packaging/prometheus && promtool check rules alerts.yml && promtool test rules alerts_test.yml)

section "build the .deb and the .rpm (nfpm)"
packaging/build.sh

section "install the .deb into a clean Debian 12 root"
packaging/test-install.sh

section "packaging CI passed"
