"""The systemd units pass `systemd-analyze verify` without a single warning, and agree with
the example configuration."""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
from dataclasses import fields
from pathlib import Path

import pytest

from flare.daemon.config import DaemonConfig, load_config
from flare.daemon.lifecycle import SHUTDOWN_MARGIN_S
from flare.server.connections import ConnectionLimits

UNITS = Path(__file__).resolve().parents[2] / "systemd"


def unit_section(name: str, section: str) -> dict[str, str]:
    # Units repeat keys (Environment=); the last value is enough for the keys checked here.
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(UNITS / name)
    return dict(parser[section])


def test_units_pass_systemd_analyze_verify_without_warnings(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (it comes with systemd); the units were not verified")
    true = shutil.which("true")
    assert true is not None
    for name in ("flare.service", "flare.socket", "flare-worker.service"):
        text = (UNITS / name).read_text()
        # verify checks that ExecStart's binary exists; the install path is not on this machine.
        (tmp_path / name).write_text(text.replace("/opt/flare/venv/bin/flare", true))
    result = subprocess.run(
        [analyze, "verify", *(str(tmp_path / name) for name in ("flare.service", "flare.socket", "flare-worker.service"))],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout + result.stderr == "", "systemd-analyze verify warned:\n" + result.stdout + result.stderr


def test_service_is_a_notify_service_with_watchdog_reload_and_runtime_directory() -> None:
    service = unit_section("flare.service", "Service")
    assert service["Type"] == "notify"
    assert service["NotifyAccess"] == "main"
    assert service["ExecStart"].endswith("flare run --config /etc/flare/flare.toml")
    assert service["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert service["Restart"] == "on-failure"
    assert service["RuntimeDirectory"] == "flare"
    assert service["RestrictAddressFamilies"] == "AF_UNIX AF_INET AF_INET6"
    assert "WatchdogSec" in service


def test_stop_timeout_outlasts_the_drain_grace_period_plus_the_shutdown_margin() -> None:
    service = unit_section("flare.service", "Service")
    stop = re.fullmatch(r"(\d+)s", service["TimeoutStopSec"])
    assert stop is not None
    config = load_config(None, {}, UNITS / "flare.toml")
    assert int(stop.group(1)) > config.drain_grace_s + SHUTDOWN_MARGIN_S


def test_the_file_descriptor_limit_fits_the_connection_bound_and_its_reserve() -> None:
    service = unit_section("flare.service", "Service")
    config = load_config(None, {}, UNITS / "flare.toml")
    limits = ConnectionLimits.from_config(config)
    assert int(service["LimitNOFILE"]) >= limits.file_descriptors_needed


def test_socket_unit_listens_on_loopback_http() -> None:
    assert unit_section("flare.socket", "Socket")["ListenStream"] == "127.0.0.1:8000"


def test_example_config_loads_and_documents_every_setting() -> None:
    config = load_config(None, {}, UNITS / "flare.toml")
    assert config.control_socket == Path("/run/flare/control.sock")
    text = (UNITS / "flare.toml").read_text()
    settings = [f.name for f in fields(DaemonConfig)] + ["api_key_file"]
    undocumented = [s for s in settings if not re.search(rf"^(# )?{s} = ", text, re.MULTILINE)]
    assert undocumented == []


def test_the_worker_unit_runs_flare_headless_and_restarts_on_failure() -> None:
    service = unit_section("flare-worker.service", "Service")
    assert service["ExecStart"].endswith("flare run --config /etc/flare/flare.toml")
    assert service["Restart"] == "on-failure"
    assert "WatchdogSec" not in service and "NotifyAccess" not in service, "a headless host sends no READY or pings"
    assert service["User"] == "flare"
