"""The conf/ tree (and the server's playground page) travel inside the wheel, and an installed wheel
finds the conf/ tree."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_carries_conf_and_finds_it(tmp_path):
    # Offline: no build isolation, so pip uses the hatchling of this environment.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True, timeout=300)
    wheel = next(tmp_path.glob("megalm-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"megalm/conf/{p.relative_to(ROOT / 'conf')}" for p in (ROOT / "conf").rglob("*.yaml")}
    assert shipped and shipped <= names
    assert "megalm/serve/playground.html" in names  # the server's page is read from the installed package
    # megalm's Hydra launchers, in Hydra's plugin namespace (a namespace package: no __init__.py of its own)
    assert "hydra_plugins/megalm_launcher/megalm_launcher.py" in names and "hydra_plugins/__init__.py" not in names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    out = subprocess.run(
        [sys.executable, "-c", "import megalm.config as c; print(c.__file__); print(c.conf_dir())"],
        cwd=tmp_path, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}, capture_output=True,
        text=True, check=True)
    module, conf = out.stdout.split()
    assert module.startswith(str(site)) and conf == str(site / "megalm" / "conf")
