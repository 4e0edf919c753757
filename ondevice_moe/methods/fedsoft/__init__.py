"""FedSoft (Ruan & Joe-Wong, 2022): soft clustered federation with proximal local updates, and IFCA."""
