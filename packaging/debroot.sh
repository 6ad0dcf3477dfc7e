# Sourced by test-install.sh and test-debian.sh: a fresh Debian 12 root for one run, copied from a
# debootstrapped bookworm that is cached between runs, and taken down on exit.
#   debroot_make [CACHE]   sets $root (CACHE default /var/cache/maintd-ci/bookworm; made if absent)
#   in_root CMD...         runs CMD in $root with a clean environment
# Debian's .debs that apt fetches are kept in $CACHE.apt (bind-mounted as the root's apt archive),
# so a second run downloads nothing. Needs root, debootstrap and deb.debian.org (a package registry).

debroot_make() {
    local cache=${1:-/var/cache/maintd-ci/bookworm}
    local mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
    if [ ! -x "$cache/usr/bin/apt-get" ]; then
        echo "== debootstrap bookworm into $cache"
        rm -rf "$cache" && mkdir -p "$(dirname "$cache")"
        debootstrap --variant=minbase bookworm "$cache.partial" "$mirror" >/dev/null
        mv "$cache.partial" "$cache"   # a run cut short never leaves a half root to be reused
    fi
    mkdir -p "$cache.apt/partial"
    root=$(mktemp -d /var/tmp/maintd-root.XXXXXX)
    trap debroot_remove EXIT
    echo "== fresh root $root (a copy of the cached bookworm)"
    cp -a "$cache/." "$root/"
    mount -t proc proc "$root/proc"
    mount --bind /dev "$root/dev"
    mount --bind /dev/pts "$root/dev/pts"    # apt's terminal log
    mount --bind "$cache.apt" "$root/var/cache/apt/archives"
    cp /etc/resolv.conf "$root/etc/resolv.conf"
}

debroot_remove() {
    for m in var/cache/apt/archives dev/pts proc dev; do
        umount -l "$root/$m" 2>/dev/null || true
    done
    rm -rf "$root"
}

in_root() { chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 "$@"; }
