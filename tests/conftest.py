import sys
from pathlib import Path

# let test modules import shared helpers from each other (e.g. make_trace)
sys.path.insert(0, str(Path(__file__).parent))
