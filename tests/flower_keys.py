"""TLS files and SuperNode keys for the Flower deployment tests: the package's own
(:mod:`fedskew.flower.credentials`, what a secure-by-default deployment makes for itself)."""

from fedskew.flower.credentials import Tls, write_node_key, write_tls

__all__ = ["Tls", "write_node_key", "write_tls"]
