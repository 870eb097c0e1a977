"""fedskew: federated learning under non-IID data."""

__version__ = "0.1.0"
