"""Imported first by the tests of the blob store backend: they need the `azure` extra
(`pip install maintd[azure]`, which ./dev.sh installs). Debian 12 packages no azure-storage-blob, so
the run on Debian's libraries (packaging/test-debian.sh) skips them, saying why."""

import pytest

pytest.importorskip("azure.storage.blob", reason="needs the azure extra (pip install 'maintd[azure]'); "
                    "Debian 12 has no azure-storage-blob package")
