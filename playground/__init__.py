"""The playground's logic, importable and testable without a browser: app.py only lays it out and wires it."""
from .handlers import Playground

__all__ = ["Playground"]
