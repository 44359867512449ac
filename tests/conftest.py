import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(Path(__file__).parent))  # spawned rank bodies import their test module by name
os.environ.setdefault("OMP_NUM_THREADS", "1")
