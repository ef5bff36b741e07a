"""Export a megapipe checkpoint (any mesh) to a transformers directory with the run's tokenizer.

    python tools/export_hf.py --checkpoint runs/shakespeare_tiny --out out/hf
    python tools/export_hf.py --checkpoint runs/x/checkpoints/step_00000400 --out out/hf --force

The command line is megapipe/cli/export_hf.py's (its options, what it prints, its errors).
"""

import sys

from megapipe.cli.export_hf import main

if __name__ == "__main__":
    sys.exit(main())
