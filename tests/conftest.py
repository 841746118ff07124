"""Test-session setup.

Eight fake CPU devices for sharding tests: the flag must be set before JAX is imported anywhere.
"""
import os

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


def pytest_collection_modifyitems(config, items):
    if config.getoption("--studies"):
        return
    import pytest
    skip = pytest.mark.skip(reason="a study: run with `pytest --studies` (`laminar simulate configs/sim/paper_7b_math.yaml` prints the same table)")
    for item in items:
        if "study" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """Starts the supervised warm-ups the selected tests need (runtime_fixtures.WARM_UPS) in the
    background, niced: they train on the cores the in-process tests leave idle instead of in
    front of the first runtime test (~50 s of the suite before)."""
    names = sorted({f for item in session.items for f in getattr(item, "fixturenames", ())
                    if f in ("warm_model", "countdown_model")})
    if names and not session.config.option.collectonly:
        from tests.laminar_jax.runtime.runtime_fixtures import start_warm_ups
        start_warm_ups(names, str(session.config._tmp_path_factory.getbasetemp()))


def pytest_sessionfinish(session):
    import sys
    fixtures = sys.modules.get("tests.laminar_jax.runtime.runtime_fixtures")
    if fixtures is not None:
        fixtures.stop_warm_ups()
