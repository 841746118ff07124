"""One way to call a peer, whether it is a Ray actor handle or a plain in-process object.

`call(obj.method, *args)` runs `ray.get(obj.method.remote(*args))` on an actor and
`obj.method(*args)` on a plain object, so the rollout worker and the manager run unchanged in
unit tests that drive them with in-process peers (a `DataActor`, fake rollouts).
"""
from __future__ import annotations

from typing import Any

import ray


def call(method: Any, *args: Any, timeout: float | None = None) -> Any:
    """The result of `method(*args)`, waiting for it when `method` is a Ray actor method."""
    out = method.remote(*args) if hasattr(method, "remote") else method(*args)
    return ray.get(out, timeout=timeout) if isinstance(out, ray.ObjectRef) else out


def send(method: Any, *args: Any) -> None:
    """Fire and forget on an actor; a plain call in-process."""
    if hasattr(method, "remote"):
        method.remote(*args)
    else:
        method(*args)


def node_id() -> str | None:
    """This process's Ray node id; None outside Ray."""
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
