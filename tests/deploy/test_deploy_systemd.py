"""``deploy/systemd/hicache.service``, checked by ``systemd-analyze``.

``verify`` checks that the binary of ExecStart exists, and /opt/hicache/bin/hicache (where
the unit's comment installs it) does not exist here. So the unit is verified twice: as
shipped, where the one complaint must be that missing binary, and as a temporary copy whose
ExecStart names the ``hicache`` on PATH, which must verify with no message at all.
``security --offline`` then scores its sandboxing.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tests.deploy.deploy_helpers import DEPLOY, run, tool

UNIT = DEPLOY / "systemd" / "hicache.service"
SHIPPED_BINARY = "/opt/hicache/bin/hicache"


def unit_with_installed_binary(tmp_path: Path) -> Path:
    """A copy of the unit whose ExecStart names the installed ``hicache`` (the only change)."""
    installed = shutil.which("hicache")
    if installed is None:
        pytest.fail("the hicache command is not on PATH (pip install -e .)")
    text = UNIT.read_text()
    assert text.count(f"ExecStart={SHIPPED_BINARY} ") == 1
    copy = tmp_path / "hicache.service"
    copy.write_text(text.replace(f"ExecStart={SHIPPED_BINARY} ", f"ExecStart={installed} "))
    return copy


def directives() -> dict[str, dict[str, list[str]]]:
    """Section -> directive -> every value it is given."""
    out: dict[str, dict[str, list[str]]] = {}
    section = ""
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            out[section] = {}
            continue
        key, _, value = line.partition("=")
        out[section].setdefault(key, []).append(value)
    return out


def test_verify_with_the_installed_binary(tmp_path: Path) -> None:
    """``systemd-analyze verify`` accepts the unit, with no message, once ExecStart names an
    existing binary."""
    proc = run([tool("systemd-analyze"), "verify", str(unit_with_installed_binary(tmp_path))])
    assert proc.returncode == 0 and not (proc.stdout + proc.stderr).strip(), proc.stdout + proc.stderr


def test_verify_as_shipped_complains_only_of_the_binary() -> None:
    """As shipped, verify fails only because /opt/hicache/bin/hicache is not installed here."""
    proc = run([tool("systemd-analyze"), "verify", str(UNIT)])
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode != 0
    assert lines and all(SHIPPED_BINARY in line and "not executable" in line for line in lines), lines


def test_verify_catches_a_bad_unit(tmp_path: Path) -> None:
    """verify is a real check: a misspelt directive is reported."""
    copy = unit_with_installed_binary(tmp_path)
    copy.write_text(copy.read_text().replace("ProtectSystem=strict", "ProtectSystem=strict\nProtectSytem=full"))
    proc = run([tool("systemd-analyze"), "verify", str(copy)])
    assert "ProtectSytem" in proc.stdout + proc.stderr


def test_security_exposure(tmp_path: Path) -> None:
    """``systemd-analyze security --offline`` rates the unit's exposure at most 4.0 ("OK")."""
    proc = run([tool("systemd-analyze"), "security", "--offline=true", "--threshold=40",
                str(unit_with_installed_binary(tmp_path))])
    out = proc.stdout + proc.stderr
    m = re.search(r"Overall exposure level for hicache\.service: (\d+\.\d+)", out)
    assert proc.returncode == 0 and m and float(m.group(1)) <= 4.0, out[-2000:]


def test_required_directives() -> None:
    """A dedicated user, a RuntimeDirectory for the sockets (the daemon's runtime dir goes
    there through XDG_RUNTIME_DIR), ProtectSystem=strict, PrivateTmp, NoNewPrivileges,
    restart on failure but not for a refused config (exit 2), SIGTERM to the launcher only."""
    d = directives()["Service"]
    assert d["User"] == ["hicache"] and d["Group"] == ["hicache"]
    assert d["RuntimeDirectory"] == ["hicache"]
    assert "XDG_RUNTIME_DIR=/run/hicache" in d["Environment"]
    assert d["ProtectSystem"] == ["strict"]
    assert d["PrivateTmp"] == ["true"] and d["NoNewPrivileges"] == ["true"]
    assert d["Restart"] == ["on-failure"] and d["RestartPreventExitStatus"] == ["2"]
    assert d["KillMode"] == ["mixed"] and d["KillSignal"] == ["SIGTERM"]
    assert re.fullmatch(rf"{re.escape(SHIPPED_BINARY)} serve --config /etc/hicache/hicache\.yaml", d["ExecStart"][0])
    # the L3 directory of the config it is meant to run is one ProtectSystem=strict leaves writable
    assert d["CacheDirectory"] == ["hicache"]
    assert "dir: /var/cache/hicache/l3" in (DEPLOY / "config" / "embedded.yaml").read_text()
