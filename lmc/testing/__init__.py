"""Test helpers shared by lmc's tests and benches: tiny random checkpoints built locally."""

from lmc.testing.checkpoints import FAMILIES, make_checkpoint

__all__ = ["FAMILIES", "make_checkpoint"]
