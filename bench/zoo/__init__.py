"""A zoo of tiny `transformers` models under parc's plans (issue 24, item 8).

Reading order: families.py (which models, built how), rules.py (tp rules: the family's own tp plan, or derived
from the graph as `parc plan` does), plans.py (the plans tried), run.py (one family × plan: compile, train 3 steps
on gloo CPU ranks, compare with serial, classify), sweep.py (all of them, the table in docs/tensor-parallel.md).
"""
