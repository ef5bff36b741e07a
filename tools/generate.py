"""Sample text from a megapipe checkpoint (or an HF directory written by `GPT.to_hf`).

    python tools/generate.py --checkpoint runs/tiny --prompt "To be" --max-new-tokens 50
    python tools/generate.py --hf out/hf --tokenizer data/shakespeare/tokenizer.model

The command line is megapipe/cli/generate.py's (its options, what it prints, its errors).
"""

import sys

from megapipe.cli.generate import main

if __name__ == "__main__":
    sys.exit(main())
