"""Install the example storage plug-in (``examples/sqlite_store``) the way a user would.

``install_sqlite_plugin(target)`` builds a wheel of it (its module, and a ``dist-info``
whose ``entry_points.txt`` carries the entry points its ``pyproject.toml`` declares) and
installs that wheel with pip into ``target`` (``--target``, no index, no dependencies), so
that a process with ``target`` on its path finds the plug-in exactly as it finds an
installed package's: through ``importlib.metadata`` entry points.
"""

from __future__ import annotations

import base64
import hashlib
import re
import subprocess
import sys
import zipfile
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sqlite_store"
MODULE = "hicache_sqlite_store"
DIST, VERSION = "hicache_sqlite_store", "0.1.0"


def declared_entry_points(pyproject: Path) -> dict[str, dict[str, str]]:
    """``[project.entry-points."group"]`` tables of ``pyproject`` as ``{group: {name: value}}``."""
    groups: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    for line in pyproject.read_text().splitlines():
        header = re.fullmatch(r'\s*\[project\.entry-points\."([^"]+)"\]\s*', line)
        if header:
            current = groups.setdefault(header.group(1), {})
        elif line.strip().startswith("["):
            current = None
        elif current is not None and "=" in line and not line.strip().startswith("#"):
            name, _, value = line.partition("=")
            current[name.strip()] = value.strip().strip('"')
    return groups


def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def build_wheel(out_dir: Path) -> Path:
    info = f"{DIST}-{VERSION}.dist-info"
    entry_points = "".join(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in names.items()) + "\n"
                           for group, names in declared_entry_points(EXAMPLE / "pyproject.toml").items())
    files = {
        f"{MODULE}.py": (EXAMPLE / f"{MODULE}.py").read_bytes(),
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: hicache-sqlite-store\nVersion: {VERSION}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: hicache-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{info}/entry_points.txt": entry_points.encode(),
    }
    record = [_record_line(p, d) for p, d in files.items()] + [f"{info}/RECORD,,"]
    wheel = out_dir / f"{DIST}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
        zf.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return wheel


def install_sqlite_plugin(target: Path) -> Path:
    """Install the example plug-in into ``target`` (created); return ``target``."""
    target.mkdir(parents=True, exist_ok=True)
    wheel = build_wheel(target.parent)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
                    "--no-index", "--target", str(target), str(wheel)], check=True, timeout=120)
    return target
