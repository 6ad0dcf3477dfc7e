#!/bin/sh
# Stop maintd (and its socket) before the files go, on removal only (not on upgrade).
set -e
if [ -d /run/systemd/system ] && { [ "$1" = remove ] || [ "$1" = 0 ]; }; then
    systemctl stop maintd.service maintd.socket >/dev/null 2>&1 || true
    systemctl disable maintd.service maintd.socket >/dev/null 2>&1 || true
fi
exit 0
