"""The version comes from one place, agent/__init__.py: `maintd --version`, the package names packaging/build.sh
gives the .deb and .rpm, `/v1/status`, the `maintd_build_info` metric, the README's install lines and the newest
entry of CHANGELOG.md all say the same."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from agent import __version__
from agent.telemetry.metrics import Metrics
from tests.e2e.harness import CLEAN_ENV, Agent, free_port

ROOT = Path(__file__).resolve().parents[2]


def changelog_versions() -> list[str]:
    return re.findall(r"^## \[(\d+\.\d+\.\d+[^\]]*)\]", (ROOT / "CHANGELOG.md").read_text(), re.M)


def test_the_changelogs_newest_version_is_the_package_version():
    versions = changelog_versions()
    assert versions and versions[0] == __version__, f"CHANGELOG.md: {versions[:1]}, the package: {__version__}"
    assert versions == sorted(versions, key=lambda v: tuple(int(x) for x in v.split(".")), reverse=True)


def test_each_version_has_an_upgrading_section_and_a_link():
    text = (ROOT / "CHANGELOG.md").read_text()
    sections = [s for s in re.split(r"^## ", text, flags=re.M)[1:] if not s.startswith("[Unreleased]")]
    for version, body in zip(changelog_versions(), sections, strict=True):
        assert "### Upgrading" in body, f"{version} says what an operator must do"
        assert re.search(rf"^\[{re.escape(version)}\]: https://", text, re.M), f"{version} has its link"


def test_maintd_version_and_the_build_info_metric():
    done = subprocess.run([sys.executable, "-m", "agent", "--version"], capture_output=True, text=True,
                          env=CLEAN_ENV, timeout=30)
    assert done.stdout.strip() == f"maintd {__version__}"
    assert f'maintd_build_info{{version="{__version__}"}} 1.0' in Metrics().render().decode()


def test_a_running_daemon_reports_the_version(tmp_path):
    """/v1/status and /metrics of a real `maintd run` (IMDS unreachable: it still answers)."""
    agent = Agent(tmp_path / "vm", f"http://127.0.0.1:{free_port()}", "vm-1")
    try:
        assert agent.get("/v1/status").json()["version"] == __version__
        assert f'maintd_build_info{{version="{__version__}"}} 1.0' in agent.get("/metrics").text
    finally:
        agent.stop()


def test_the_packages_and_the_readme_are_named_by_the_version():
    """packaging/build.sh reads the version the way it does when it builds (its VERSION= line, run here)."""
    build = (ROOT / "packaging" / "build.sh").read_text()
    line = next(x for x in build.splitlines() if x.startswith("VERSION="))
    shown = subprocess.run(["bash", "-c", f"{line}; echo $VERSION"], cwd=ROOT, capture_output=True, text=True,
                           timeout=30).stdout.strip()
    assert shown == __version__
    assert "version: ${VERSION}" in (ROOT / "packaging" / "nfpm.yaml").read_text()
    readme = (ROOT / "README.md").read_text()
    install = readme[readme.index("<!-- install:start -->"):readme.index("<!-- install:end -->")]
    assert f"dist/maintd_{__version__}-1_all.deb" in install and f"dist/maintd-{__version__}-1.noarch.rpm" in install
    assert re.findall(r"maintd[_-](\d+\.\d+\.\d+)-1", install) == [__version__] * 3
