"""The `quantkit` command: one module per command (quantize, inspect, eval, merge, report, recipes)
and app, which registers them. The only layer that prints or exits: QuantkitErrors become one-line
messages and their exit codes here. `quantkit --help` imports no torch."""
