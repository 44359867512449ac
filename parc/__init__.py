"""parc: a declarative graph compiler for parallel training plans.

Start reading at `parc.cli` (the commands), then `parc.compiler` (plan + model →
compiled/), then `parc.runtime.train` (what `torchrun -m parc.run` executes).
"""

__version__ = "0.1.0"
