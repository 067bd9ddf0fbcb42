"""kvram's version: a leaf, so that any module can say which kvram it is."""

__version__ = "0.1.0"
