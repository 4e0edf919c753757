"""FLoRAL (Almansoori et al.): per-client mixtures of federated low-rank adaptors."""
