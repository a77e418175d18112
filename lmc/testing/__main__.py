"""`python -m lmc.testing FAMILY OUT_DIR [--seed N]`: write a tiny random HF checkpoint."""

from lmc.testing.checkpoints import main

raise SystemExit(main())
