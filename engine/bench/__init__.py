"""`python -m engine.bench ...`: the command line over engine/measure, and the tools only a command line needs
(docs/engine.md lists them). Nothing imports this package but its own command line and its tests.
"""
