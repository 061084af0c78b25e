"""The `quantkit` command: one module per command (quantize, inspect, eval, serve-check, merge, plan,
recipes), app, which registers them, and options, where every option is declared once and the groups
of them several commands share become one typed record each. The only layer that prints or exits:
QuantkitErrors become one-line messages and their exit codes here. `quantkit --help` imports no torch."""
