#!/bin/sh
# Reload systemd's unit files when systemd runs this machine; never start anything elsewhere
# (a chroot, a container build, an image bake).
set -e
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || true
    if systemctl is-active --quiet maintd.service; then
        systemctl try-restart maintd.service >/dev/null 2>&1 || true
    fi
fi
exit 0
