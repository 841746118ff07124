"""Test-session setup.

Eight fake CPU devices for sharding tests: the flag must be set before JAX is imported anywhere.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Ray 2.60 turns on token auth and binds to the interface address by default; keep tests on loopback.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def pytest_addoption(parser):
    parser.addoption("--studies", action="store_true",
                     help="also run the `study` tests (full paper-table calibration; minutes)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--studies"):
        return
    import pytest
    skip = pytest.mark.skip(reason="a study: run with `pytest --studies` (`laminar simulate configs/sim/paper_7b_math.yaml` prints the same table)")
    for item in items:
        if "study" in item.keywords:
            item.add_marker(skip)
