"""Per-user text: sources, train/valid/test splits, and blocks of tokens."""
