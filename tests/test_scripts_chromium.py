"""scripts/chromium as a user meets it: run by bash with a PATH of fake commands.

The fakes (``apt-get``, ``id``, ``chromium``) are small shell scripts in a temporary
folder that record how they were called; nothing is installed and nothing leaves the
machine.  ``DSHIM_TEST_CHROMIUM_DEFAULT`` points the script's default browser path at a
file that does not exist, as on a machine without Chromium.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "chromium"
BASH = shutil.which("bash") or "/bin/bash"


def fake(bin_dir: Path, name: str, body: str) -> Path:
    path = bin_dir / name
    path.write_text(f"#!{BASH}\n{body}\n")
    path.chmod(0o755)
    return path


def run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    full = {
        "PATH": str(bin_dir),
        "HOME": str(tmp_path),
        "DSHIM_TEST_CHROMIUM_DEFAULT": str(tmp_path / "no-such-chromium"),
        **env,
    }
    return subprocess.run(
        [BASH, str(SCRIPT)], env=full, capture_output=True, text=True, timeout=30, check=False
    )


def test_an_executable_chromium_is_used_and_nothing_is_installed(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "apt-calls"
    fake(bin_dir, "apt-get", f'echo "$@" >> {calls}')
    browser = fake(tmp_path, "my-chromium", "exit 0")
    r = run(tmp_path, CHROMIUM=str(browser))
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")
    assert not calls.exists()


def test_a_chromium_that_is_not_executable_is_refused(tmp_path: Path) -> None:
    missing = tmp_path / "gone" / "chromium"
    r = run(tmp_path, CHROMIUM=str(missing))
    assert r.returncode == 1
    assert f"CHROMIUM={missing} is not an executable file" in r.stderr
    folder = run(tmp_path, CHROMIUM=str(tmp_path))
    assert folder.returncode == 1
    assert "is not an executable file" in folder.stderr


def test_without_apt_get_it_says_what_is_needed(tmp_path: Path) -> None:
    r = run(tmp_path)
    assert r.returncode == 1
    assert "there is no apt-get to install it" in r.stderr
    assert "Install Chromium" in r.stderr
    assert "export CHROMIUM=/path/to/chromium" in r.stderr


def test_without_apt_get_a_chromium_on_path_is_named(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    browser = fake(bin_dir, "chromium-browser", "exit 0")
    r = run(tmp_path)
    assert r.returncode == 1
    assert f"export CHROMIUM={browser}" in r.stderr


def test_as_root_with_apt_get_it_installs_debians_chromium(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "apt-calls"
    fake(bin_dir, "apt-get", f'echo "$DEBIAN_FRONTEND $*" >> {calls}')
    fake(bin_dir, "id", "echo 0")
    r = run(tmp_path)
    assert r.returncode == 0, r.stderr
    assert "installing Debian's chromium" in r.stderr
    assert calls.read_text().splitlines() == [
        " update -q",
        "noninteractive install -y -q --no-install-recommends chromium",
    ]


def test_not_root_without_sudo_it_says_how(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "apt-calls"
    fake(bin_dir, "apt-get", f'echo "$@" >> {calls}')
    fake(bin_dir, "id", "echo 1000")
    r = run(tmp_path)
    assert r.returncode == 1
    assert "run this as root, or install Chromium yourself" in r.stderr
    assert "export CHROMIUM=/path/to/chromium" in r.stderr
    assert not calls.exists()
