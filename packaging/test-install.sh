#!/usr/bin/env bash
# Install dist/maintd_*.deb with apt into a clean Debian 12 root (debootstrap) and run it there
# with Debian's own library versions: maintd --version, check-config of the shipped files, an
# upgrade in place (reinstall under a running maintd: the conffile and the state are kept, nothing
# that had finished runs again), root's CLI over the default unix socket, demo.
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
echo "== /etc/maintd/maintd.yaml is a conffile"
in_root dpkg-query -W -f='${Conffiles}\n' maintd | grep -q '/etc/maintd/maintd.yaml'

echo "== upgrade in place: the .deb reinstalled under a running maintd with an event in flight"
# The state an earlier maintd left mid-preparation (format 1: `first` done, `second` cut short), the
# admin's own config (emulated IMDS on loopback, three hooks), maintd running on it; then apt
# reinstalls the package, and maintd is restarted as the postinst does under systemd.
eid=$(sed -n 's/^EVENT_ID = "\(.*\)"$/\1/p' tests/fixtures/make_state_dirs.py)
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cp tests/fixtures/state-format-1/mid-preparation/* "$root/var/lib/maintd/"
python3 -m tests.fixtures.make_state_dirs --now "$root/var/lib/maintd"   # its NotBefore an hour from now
hook() { echo "  - {name: $1, type: exec, phases: [scheduled], command: [/bin/sh, -c, 'echo $1:\$MAINTD_ATTEMPT >> /var/lib/maintd-runs']}"; }
{
    echo "# edited by the admin"
    echo "imds: {endpoint: \"http://127.0.0.1:$port\", poll_interval: 200ms}"
    echo "identity: {name: vm-1}"
    echo "state: {dir: /var/lib/maintd}"
    echo "server: {listen: \"127.0.0.1:$((port + 1))\"}"
    echo "handlers:"
    hook first; hook second; hook third
} > "$root/etc/maintd/maintd.yaml"
in_root maintd check-config /etc/maintd/maintd.yaml
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; debroot_remove' EXIT
run_bg() { chroot "$root" /usr/bin/env -i PATH=/usr/bin:/bin LANG=C.UTF-8 "$@" >>"$root/tmp/bg.log" 2>&1 & pids+=($!); }
wait_for() {  # wait_for WHAT CMD...: up to 60 s
    local what=$1; shift
    for _ in $(seq 300); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
    echo "timed out waiting for $what; logs:" >&2; tail -20 "$root/tmp/bg.log" >&2; return 1
}
run_bg maintd emulate --port "$port" --vm vm-1 --started-duration 3600
wait_for "the emulator" in_root python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/admin/events')"
in_root python3 -c "import json, urllib.request as u; u.urlopen(u.Request('http://127.0.0.1:$port/admin/events',
    json.dumps({'event_type': 'Reboot', 'resources': ['vm-1'], 'notice': 3600, 'event_id': '$eid'}).encode()))"
run_bg maintd run --config /etc/maintd/maintd.yaml
maintd_pid=${pids[-1]}
approved() { grep -q '"approval":{[^}]*"status":"sent"' "$root/var/lib/maintd/state.json"; }
wait_for "the event carried on to its approval" approved
in_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --reinstall "/tmp/$(basename "$deb")" >/dev/null
grep -q "^# edited by the admin" "$root/etc/maintd/maintd.yaml"
approved && kill -0 "$maintd_pid"
kill -TERM "$maintd_pid" && wait "$maintd_pid" || true
run_bg maintd run --config /etc/maintd/maintd.yaml
started_twice() { [ "$(grep -c '"daemon.started"' "$root/tmp/bg.log")" -ge 2 ]; }
wait_for "maintd to start again" started_twice
sleep 2    # ten polls: time for anything it would wrongly rerun
runs=$(sort "$root/var/lib/maintd-runs" | tr '\n' ' ')
[ "$runs" = "second:2 third:1 " ] || { echo "hooks ran: $runs (want second:2 third:1)" >&2; exit 1; }
approved
echo "   kept: the admin's config, the state (nothing that had finished ran again: $runs)"
echo "== secure by default: root's CLI acts over /run/maintd/maintd.sock, a tokenless loopback POST is 401"
in_root maintd drain --reason install-test | grep -q "out of rotation: install-test"
in_root maintd undrain | grep -q "manual drain lifted"
in_root python3 -c "import urllib.error as e, urllib.request as u
try: u.urlopen(u.Request('http://127.0.0.1:$((port + 1))/v1/drain', b'', method='POST'))
except e.HTTPError as refused: raise SystemExit(0 if refused.code == 401 else refused.code)
raise SystemExit('a tokenless loopback drain was accepted')"
kill "${pids[@]}" 2>/dev/null || true
wait "${pids[@]}" 2>/dev/null || true
pids=()
echo "== no service was started (not under systemd here)"
if grep -qs "maintd.run" "$root"/proc/[0-9]*/cmdline; then echo "a maintd service was started" >&2; exit 1; fi
echo "== maintd demo"
in_root timeout 180 maintd demo
echo "== install test passed"
