"""The `laminar` command.

    laminar config show CONFIG [key=value ...]   print the resolved config as YAML
    laminar sft [CONFIG] [key=value ...]         supervised warm-up (laminar_jax.learner.sft)
    laminar train [CONFIG] [key=value ...]       RL post-training (laminar_jax.runtime.driver)
    laminar simulate CONFIG [key=value ...]      discrete-event simulator (laminar_jax.sim.cli)
    laminar plot RUN [RUN ...] [--out DIR]       PNG panels of run folders (laminar_jax.plot)

Heavy modules (jax, ray) are imported inside the handlers, after the config has loaded, so
`--help` is instant and a config error costs nothing. Config errors, and the inputs
`laminar_jax.preflight` finds unusable before Ray starts, print one line and exit 2.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import pathlib
import re
import sys
from typing import Callable, Sequence

DEFAULT_CONFIG = "configs/default.yaml"
EXIT_USAGE = 2
EXIT_FAILED = 1

_OVERRIDES_HELP = "dotted overrides parsed as YAML, e.g. optimizer.lr=1e-6 mesh.data=-1"


class _Usage(Exception):
    """A user-facing error: printed as `error: <message>`, exit code 2."""


def _split_config(args: Sequence[str], *, required: bool) -> tuple[str, list[str]]:
    """`[CONFIG] [key=value ...]`: the first argument is the config unless it is an override."""
    args = list(args)
    if args and "=" not in args[0]:
        if _looks_like_key(args[0]):
            raise _Usage(f"{args[0]!r} is neither a config file nor an override: an override needs '=', "
                         f"e.g. {args[0]}=VALUE")
        return args[0], args[1:]
    if required:
        raise _Usage("a CONFIG path is required before the overrides")
    return _default_config(), args


_KEY_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")


def _looks_like_key(arg: str) -> bool:
    """`optimizer.lr` (a dotted key, no such file, not a YAML name): an override missing its '='."""
    return (bool(_KEY_RE.match(arg)) and not arg.endswith((".yaml", ".yml", ".json"))
            and not pathlib.Path(arg).exists())


def _default_config() -> str:
    repo_root = pathlib.Path(__file__).resolve().parent.parent
    for candidate in (pathlib.Path(DEFAULT_CONFIG), repo_root / DEFAULT_CONFIG):
        if candidate.is_file():
            return str(candidate)
    raise _Usage(f"no CONFIG given and {DEFAULT_CONFIG} is not in the current directory "
                 f"or in {repo_root}")


def _load(config_path: str, overrides: Sequence[str]):
    from laminar_jax.config import load_config
    return load_config(config_path, overrides)


def _import_entry(module: str, attr: str, what: str, hint: str = "") -> Callable:
    """Import `module.attr`; a missing module means that part of the system is not built yet."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        parts = module.split(".")
        if e.name in {".".join(parts[:i]) for i in range(1, len(parts) + 1)}:
            raise _Usage(f"{what} is not built yet ({module} does not exist){hint}") from None
        raise
    return getattr(mod, attr)


def _cmd_config_show(ns: argparse.Namespace) -> int:
    from laminar_jax.config import dump_yaml
    path, overrides = _split_config(ns.args, required=True)
    sys.stdout.write(dump_yaml(_load(path, overrides)))
    return 0


def _preflight(check: str, cfg, path: str):
    """The pre-Ray checks (laminar_jax.preflight); warnings go to stderr, one line each. Returns
    the check's result."""
    from laminar_jax import preflight
    result = getattr(preflight, check)(cfg, source=path)
    for line in result if isinstance(result, list) else result.warnings:
        print(f"warning: {line}", file=sys.stderr, flush=True)
    return result


def _cmd_sft(ns: argparse.Namespace) -> int:
    path, overrides = _split_config(ns.args, required=False)
    cfg = _load(path, overrides)
    _preflight("check_sft", cfg, path)
    run = _import_entry("laminar_jax.learner.sft", "run", "supervised training")
    from laminar_jax.runtime import compile_cache
    compile_cache.enable(cfg.run.compile_cache)
    run(cfg)
    return 0


def _cmd_train(ns: argparse.Namespace) -> int:
    path, overrides = _split_config(ns.args, required=False)
    cfg = _load(path, overrides)
    inputs = _preflight("train_inputs", cfg, path)
    run = _import_entry("laminar_jax.runtime.driver", "run", "the RL runtime",
                        "; `laminar sft` runs supervised training meanwhile")
    # the dataset and prompt lengths the checks loaded: the run does not load them again
    return _with_resume_hint(functools.partial(run, inputs=inputs), cfg, ns.args)


def _with_resume_hint(run: Callable, cfg, args: Sequence[str]) -> int:
    """Run `laminar train`; a crash (or Ctrl-C) prints its traceback, then what the run folder
    keeps and the exact command that resumes it. Exit code 1 (130 for Ctrl-C). A run that stopped
    itself (a reward failing past reward.max_error_rate, a liveness stop) gets the hint and one
    `error:` line, no traceback."""
    from laminar_jax.config_loader import ConfigError
    from laminar_jax.rewards.health import RewardFailure
    from laminar_jax.runtime.liveness import LivenessError
    try:
        run(cfg)
    except (_Usage, ConfigError):
        raise
    except (RewardFailure, LivenessError):
        # the run stopped itself and says why (one line from `main`, no traceback): how to go on
        from laminar_jax.runtime.run_folder import resume_hint
        print(resume_hint(cfg, args), file=sys.stderr, flush=True)
        raise
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - any crash gets the hint
        import traceback

        from laminar_jax.runtime.run_folder import resume_hint
        traceback.print_exc()
        print(f"laminar train crashed: {type(e).__name__}: {e}\n{resume_hint(cfg, args)}",
              file=sys.stderr, flush=True)
        return 130 if isinstance(e, KeyboardInterrupt) else 1
    return 0


def _cmd_plot(ns: argparse.Namespace) -> int:
    plot_main = _import_entry("laminar_jax.plot", "main", "plotting")
    try:
        return plot_main(ns.args)
    except (FileNotFoundError, ValueError) as e:  # a missing or non-run folder, a bad panel name
        raise _Usage(str(e)) from None


def _cmd_simulate(ns: argparse.Namespace) -> int:
    path, overrides = _split_config(ns.args, required=True)
    sim_main = _import_entry("laminar_jax.sim.cli", "main", "the simulator")
    rc = sim_main(path, overrides)
    return rc if isinstance(rc, int) else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="laminar",
        description="Laminar-JAX: trajectory-level asynchronous RL post-training in JAX.",
        epilog="CONFIG is a YAML file (see configs/); overrides are dotted key=value pairs.")
    from laminar_jax import __version__
    parser.add_argument("--version", action="version", version=f"laminar-jax {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    config = sub.add_parser("config", help="inspect configs")
    config_sub = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    show = config_sub.add_parser("show", help="print the resolved config as YAML",
                                 description="Print CONFIG with overrides applied, every key "
                                             "resolved (defaults included).")
    show.add_argument("args", nargs="+", metavar="CONFIG [key=value ...]", help=_OVERRIDES_HELP)
    show.set_defaults(handler=_cmd_config_show)

    for name, handler, text in (
            ("sft", _cmd_sft, "supervised warm-up on the task's reference answers"),
            ("train", _cmd_train, "RL post-training (learner, rollouts, relays, manager)")):
        p = sub.add_parser(name, help=text, description=f"{text[0].upper()}{text[1:]}. "
                           f"CONFIG defaults to {DEFAULT_CONFIG}.")
        p.add_argument("args", nargs="*", metavar="[CONFIG] [key=value ...]", help=_OVERRIDES_HELP)
        p.set_defaults(handler=handler)

    sim = sub.add_parser("simulate", help="discrete-event simulation of the scheduling modes",
                         description="Replay the scheduling policies at scale with measured "
                                     "decode-latency and response-length profiles.")
    sim.add_argument("args", nargs="+", metavar="CONFIG [key=value ...]", help=_OVERRIDES_HELP)
    sim.set_defaults(handler=_cmd_simulate)

    plot = sub.add_parser("plot", help="PNG panels of run folders (reward, throughput, staleness, ...)",
                          description="Write the standard panels of one run, or several side by side "
                                      "(real or simulated run folders), as PNGs.", add_help=False)
    plot.add_argument("args", nargs=argparse.REMAINDER, metavar="RUN [RUN ...] [--out DIR]")
    plot.set_defaults(handler=_cmd_plot)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `laminar` script; returns the exit code."""
    ns = build_parser().parse_args(argv)
    from laminar_jax.config_loader import ConfigError
    from laminar_jax.rewards.health import RewardFailure
    from laminar_jax.runtime.liveness import LivenessError
    try:
        return ns.handler(ns)
    except (_Usage, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (RewardFailure, LivenessError) as e:  # the run stopped itself: one line, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
