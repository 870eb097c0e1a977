"""fedskew on Flower: one generic ``ClientApp`` and one ``ServerApp`` that run every registered algorithm.

The server side is the embedded engine's own round transaction (:class:`fedskew.engine.loop.Simulation`
driven by :func:`fedskew.experiment.runner.run_experiment`) with its executor swapped for
:class:`~fedskew.flower.server.FlowerExecutor`: each round's sampled clients are trained on the Flower
nodes that own them, through :func:`fedskew.engine.client.train_client`, and their personal state stays
there. See docs/deployment.md.

``flwr`` is imported lazily, only by this subpackage, so fedskew without the ``[flower]`` extra works and
says how to install it when a Flower runtime is asked for.
"""

from __future__ import annotations

from fedskew.errors import ConfigError

INSTALL_HINT = "pip install 'fedskew[flower]' (flwr[simulation]>=1.41,<2)"


def require_flwr() -> None:
    """Raise a one-line :class:`ConfigError` when ``flwr`` is not installed."""
    try:
        import flwr  # noqa: F401
    except ImportError as err:
        raise ConfigError(f"engine.runtime=flower-*: Flower is not installed; {INSTALL_HINT}") from err
