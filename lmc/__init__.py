"""lmc: a declarative compiler for large-model deployments."""

__version__ = "0.1.0"
