"""Layering: `rollout/` needs no `laminar_jax.runtime` (DESIGN.md; the runtime builds on the
rollout worker, never the other way round). Two checks, so it cannot come back:

- every `import` statement in rollout/*.py, module level or inside a function, is read from the
  source (AST): none names laminar_jax.runtime;
- in a fresh interpreter where importing laminar_jax.runtime raises, every rollout/ module
  imports, and so do the modules the worker loads lazily on its weight path (the relay source,
  relay group, relay reader, flat layout): nothing they pull in at module level reaches the
  runtime either.
"""
import ast
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROLLOUT = os.path.join(ROOT, "rollout")
FORBIDDEN = "laminar_jax.runtime"


def _imports(path: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append(node.module)
            if node.module == "laminar_jax":   # from laminar_jax import runtime
                out += [f"laminar_jax.{a.name}" for a in node.names]
    return out


def _rollout_modules() -> list[str]:
    return sorted(f[:-3] for f in os.listdir(ROLLOUT) if f.endswith(".py") and f != "__init__.py")


def test_no_rollout_module_names_the_runtime_in_any_import():
    bad = {m: [i for i in _imports(os.path.join(ROLLOUT, f"{m}.py"))
               if i == FORBIDDEN or i.startswith(FORBIDDEN + ".")] for m in _rollout_modules()}
    bad = {m: i for m, i in bad.items() if i}
    assert not bad, f"rollout/ imports the runtime: {bad}"
    # the check itself sees such an import (a function-level one included)
    probe = os.path.join(ROOT, "tests", "rollout", "_layering_probe.py")
    try:
        with open(probe, "w") as f:
            f.write("def f():\n    from laminar_jax.runtime.rpc import call\n")
        assert "laminar_jax.runtime.rpc" in _imports(probe)
    finally:
        os.remove(probe)


def test_every_rollout_module_imports_with_the_runtime_blocked():
    modules = [f"rollout.{m}" for m in _rollout_modules() if m not in ("vllm_engine", "vllm_ext")]
    modules += ["laminar_jax.weights.source", "laminar_jax.weights.relay_group", "laminar_jax.weights.relay",
                "laminar_jax.weights.flat"]
    script = textwrap.dedent(f"""
        import importlib, importlib.abc, sys

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == {FORBIDDEN!r} or name.startswith({FORBIDDEN!r} + "."):
                    raise ImportError("blocked: " + name)
                return None

        sys.meta_path.insert(0, Block())
        for m in {modules!r}:
            importlib.import_module(m)
        assert not any(k.startswith({FORBIDDEN!r}) for k in sys.modules), sorted(sys.modules)
        try:
            import laminar_jax.runtime.rpc
        except ImportError:
            print("blocked-ok")
    """)
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith("blocked-ok"), r.stdout   # the block was in force
