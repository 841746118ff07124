"""Laminar-JAX: trajectory-level asynchronous RL post-training in JAX.

Re-creates the system of "Laminar: A Scalable Asynchronous RL Post-Training Framework"
(arXiv 2510.12633). See DESIGN.md in the shared folder and the README for the layout.

Importing this package must stay cheap: no JAX, torch or Ray import at package level, so that
`laminar --help` is instant and rollout nodes can import pure-python parts.
"""

__version__ = "0.1.0"
