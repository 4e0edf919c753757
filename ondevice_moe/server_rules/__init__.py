"""The server-rule toolkit: what the server keeps and how uploads combine (:mod:`.rules`), the update
records and weighted means (:mod:`.aggregation`), robust rules (:mod:`.robust`), compressed transport
(:mod:`.transport`), and the rules several methods build on (per-device slots :mod:`.peers`, low-rank
rules :mod:`.low_rank_rules`, rank pruning :mod:`.rank_pruning`). It sits below the methods, whose own
rules build on it, and below the Flower apps of :mod:`ondevice_moe.federation` that run the rules."""
