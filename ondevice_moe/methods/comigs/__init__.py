"""CoMiGS (collaborative mixture of generalists and specialists) and the baselines of its Tables 2 and 5."""
