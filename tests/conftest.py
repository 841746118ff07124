"""Test-session setup.

Eight fake CPU devices for sharding tests: the flag must be set before JAX is imported anywhere.
"""
import os

import pytest

# --xla_backend_optimization_level=0: the in-process tests' time is XLA compiles of small programs
# (many shapes and configs), not running them; LLVM at -O0 cuts the CPU time of tests/laminar_jax/
# models by 28% and of tests/laminar_jax/rl by >35% (measured before/after, see git log). What they
# assert (closed forms, references, packed == unpacked) holds at any level within their tolerances.
# Ray actors are unaffected (cluster.actor_options gives each its own XLA_FLAGS), so the e2e runs'
# learners and engines compile as a user's run does. jax_disable_most_optimizations (which also
# turns off LLVM's expensive passes) was slower here: the unoptimised programs run too slowly.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Ray 2.60 turns on token auth and binds to the interface address by default; keep tests on loopback.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def pytest_addoption(parser):
    parser.addoption("--studies", action="store_true",
                     help="also run the `study` tests (full paper-table calibration; minutes)")


# The suite runs on two pytest-xdist workers (pyproject's addopts: `-n 2 --dist loadgroup`): the
# in-process tests use one core each (XLA's compiles of small programs), so one worker alone
# left a core idle for most of the suite. The end-to-end tests (E2E_PATHS: every test that
# starts Ray or a `laminar train`, or takes a warm-up or cluster fixture) are one work unit, run
# in order on one worker and sent first (xdist sends the largest unit first): two Ray runs never
# share the two cores, and the package-scoped clusters and shared run start once. The other
# worker takes the in-process tests meanwhile, one at a time. The unit is made by the scheduler
# below from the test's path: xdist's own `xdist_group` marks do nothing under pytest 9.2 (xdist
# 3.8 renames `item._nodeid`, which pytest 9.2 no longer reads).
E2E_UNIT = "e2e"
E2E_PATHS = ("tests/laminar_jax/runtime/", "tests/laminar_jax/manager/test_heartbeats.py",
             "tests/laminar_jax/manager/test_manager.py", "tests/laminar_jax/weights/test_relay_cluster.py",
             "tests/laminar_jax/weights/test_relay_transports.py")
E2E_FIXTURES = {"cluster", "relay_cluster", "warm_model", "countdown_model", "shared_run"}


def in_e2e_unit(nodeid: str) -> bool:
    return nodeid.startswith(E2E_PATHS)


def needs_e2e_unit(item) -> bool:
    """A test that starts Ray (its module imports it) or takes a cluster or warm-up fixture."""
    module = getattr(item, "module", None)
    return (module is not None and "ray" in vars(module)) or bool(E2E_FIXTURES & set(item.fixturenames))


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class E2EUnitScheduling(LoadScopeScheduling):
        """Each test its own unit, except the end-to-end tests: one unit, in collection order."""

        def _split_scope(self, nodeid: str) -> str:
            return E2E_UNIT if in_e2e_unit(nodeid) else nodeid

    return E2EUnitScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    missing = sorted({item.nodeid.split("::")[0] for item in items
                      if needs_e2e_unit(item) and not in_e2e_unit(item.nodeid)})
    if missing:
        raise pytest.UsageError(f"{', '.join(missing)} start Ray or take a cluster or warm-up fixture: add them "
                                f"to E2E_PATHS in tests/conftest.py (the suite's end-to-end unit)")
    if config.getoption("--studies"):
        return
    skip = pytest.mark.skip(reason="a study: run with `pytest --studies` (`laminar simulate configs/sim/paper_7b_math.yaml` prints the same table)")
    for item in items:
        if "study" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """Starts the supervised warm-ups the selected tests need (runtime_fixtures.WARM_UPS) in the
    background: they train while the first end-to-end tests, which need none, run. Once per
    session: under xdist, the first worker to collect starts them and the others find them under
    way."""
    names = sorted({f for item in session.items for f in getattr(item, "fixturenames", ())
                    if f in ("warm_model", "countdown_model")})
    if names and not session.config.option.collectonly:
        from tests.laminar_jax.runtime.runtime_fixtures import start_warm_ups, warm_up_root
        start_warm_ups(names, warm_up_root(session.config._tmp_path_factory))


def pytest_sessionfinish(session, exitstatus):
    import sys
    fixtures = sys.modules.get("tests.laminar_jax.runtime.runtime_fixtures")
    if fixtures is not None:
        fixtures.finish_warm_ups(interrupted=exitstatus == 2 or session.shouldstop)

