"""Flow (Panchal et al.): per-instance routing between global and local parameters."""
