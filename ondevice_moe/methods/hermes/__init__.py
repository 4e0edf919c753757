"""Hermes (heterogeneous federated PEFT via a sparse mixture of experts) and the baselines of its Tables 1–2."""
