"""The plan language, end to end: text in, a checked `Plan` out, and back to text.

Read in this order; each file has one job:

- `parc.lark`   the grammar (LALR): the shape of each statement, nothing more.
- `parser.py`   text → `Plan`: parse, check keys and value types, collect every
                mistake with its span (`parse`, `load_plan`).
- `plan.py`     the `Plan` frozen dataclasses: what a plan means, with defaults.
- `validate.py` the checks that need only a `Plan` (plus, when given, the launch's
                world size and the model's module paths and layer count).
- `printer.py`  `Plan` → canonical text, so parse → print → parse is the identity.

Diagnostics (`Span`, `Diagnostic`, `ParcError`) live in `parc/errors.py`, not here:
the passes and the runtime raise them too. Nothing in this package imports torch.
"""
