"""`laminar simulate CONFIG [key=value ...]`: simulate every selected cell of a scenario.

Prints a table of simulated throughput next to the paper's (when the config gives it), then
per-cell idle fractions, KV use and staleness, and writes one run folder per cell under
`run.out_dir/<name>/<system>_<accelerators>` (same format as a real run) plus the table as
`run.out_dir/<name>/table.md` (`run.write`: full | summary | none).
"""

from __future__ import annotations

import pathlib
import time

from laminar_jax.sim.config import SimConfig, load_sim_config

__all__ = ["main", "simulate"]


def simulate(cfg: SimConfig, *, write: str | bool | None = None, progress=None):
    """Run every selected cell of `cfg`; returns a list of `report.CellResult`.

    write: "none" | "summary" | "full" (True / False = full / none); default run.write."""
    from laminar_jax.sim.engine import Sim
    from laminar_jax.sim.report import cell_result, write_run

    write = cfg.run.write if write is None else write
    if isinstance(write, bool):
        write = "full" if write else "none"
    root = pathlib.Path(cfg.run.out_dir) / cfg.name
    results = []
    for cell in cfg.selected_cells():
        t0 = time.perf_counter()
        sim = Sim(cfg, cell).run()
        if write != "none":
            result = write_run(sim, root / f"{cell.system}_{cell.accelerators}", mode=write)
        else:
            result = cell_result(sim)
        results.append(result)
        if progress is not None:
            progress(result, time.perf_counter() - t0)
    return results


def _details_table(results):
    from rich.table import Table

    t = Table(title="per cell (measured iterations)")
    for col in ("system", "acc.", "train/rollout", "tok/s", "iter s", "rollout idle",
                "learner idle", "KV use", "gen tok/s", "staleness mean/max", "buffer/held",
                "weights wait s", "steady"):
        t.add_column(col, justify="right" if col != "system" else "left")
    for r in results:
        t.add_row(r.system, str(r.accelerators), f"{r.train}/{r.rollout}",
                  f"{r.throughput:,.0f}", f"{r.iteration_s:,.1f}", f"{r.rollout_idle_frac:.2f}",
                  f"{r.learner_idle_frac:.2f}", f"{r.kv_use:.2f}", f"{r.gen_tokens_per_s:,.0f}",
                  f"{r.staleness_mean:.2f}/{r.staleness_max}",
                  f"{r.buffer_groups_mean:.0f}/{r.held_groups_mean:.0f}", f"{r.weight_wait_s:.2f}",
                  "yes" if r.steady else f"[red]no[/red] (drift {r.occupancy_drift:+.2f} cap, "
                  f"{r.staleness_drift:+.1f} v)")
    return t


def main(config_path: str, overrides: list[str]) -> int:
    """Entry point of `laminar simulate`; returns the exit code (config errors raise)."""
    from rich.console import Console

    from laminar_jax.sim.report import markdown_table, render_table

    cfg = load_sim_config(config_path, list(overrides))
    console = Console(width=None if Console().is_terminal else 160)
    cells = cfg.selected_cells()
    if not cells:
        console.print("[red]no cell left after run.only_systems / run.only_accelerators[/red]")
        return 2

    def progress(r, seconds):
        flag = "" if r.steady else " [red]UNSTEADY: not a throughput[/red]"
        console.print(f"  {r.system:>12} @ {r.accelerators:>5}: {r.throughput:>12,.0f} tok/s{flag} "
                      f"({r.trajectories:,} trajectories, {r.sim_time_s:,.0f} s simulated, "
                      f"{seconds:.1f} s wall)")

    console.print(f"[bold]{cfg.name}[/bold]: {len(cells)} cell(s)")
    from laminar_jax.sim.engine import CapReached
    try:
        results = simulate(cfg, progress=progress)
    except CapReached as e:     # a cap is an error naming the cap and the cell, not a NaN
        console.print(f"[red]error: {e}[/red]", soft_wrap=True)
        return 1
    console.print(render_table(results, title=f"{cfg.name}: throughput (x1e5 tokens/s)",
                               tolerance=cfg.tolerance))
    console.print(_details_table(results))
    if cfg.run.write != "none":
        root = pathlib.Path(cfg.run.out_dir) / cfg.name
        (root / "table.md").write_text(markdown_table(results, tolerance=cfg.tolerance))
        console.print(f"run folders and table.md: {root}")
    return 0
