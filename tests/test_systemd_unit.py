"""The unit file passes `systemd-analyze verify` with no output at all (warnings included)."""
import shutil
import subprocess
from pathlib import Path

import pytest

from mcpd.testing import BIN

UNIT = Path(__file__).parent.parent / "systemd" / "mcpd.service"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_unit_verifies_without_warnings(tmp_path):
    # verify checks that ExecStart's and ExecReload's binaries exist: point them at the mcpd and
    # mcpctl this test run installed.
    unit = tmp_path / "mcpd.service"
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/", f"{BIN}/"))
    done = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout + done.stderr == "", done.stdout + done.stderr


def test_unit_has_the_required_settings():
    text = UNIT.read_text()
    for setting in ("Type=notify", "WatchdogSec=", "Restart=on-failure", "KillMode=mixed",
                    "RuntimeDirectory=mcpd", "StateDirectory=mcpd", "ExecReload=", "NoNewPrivileges=yes",
                    "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes", "DeviceAllow=char-nvidia"):
        assert setting in text, setting
